#include "server/snapshot_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/session_busy.h"
#include "core/status_macros.h"
#include "proto/parse_budget.h"
#include "server/log.h"
#include "server/session_transfer.h"

namespace attention::server {
namespace {

constexpr char kSessionSuffix[] = ".session";
constexpr char kTemporarySuffix[] = ".tmp";
// Largest record a file may hold: a data chunk is at most 4 MiB, a header
// with 1024 layers of 1024 sink logits about 4 MiB.
constexpr uint32_t kMaxFileRecordBytes = 64 << 20;
// Bytes gathered before one write(2).
constexpr size_t kWriteBufferBytes = 4 << 20;

absl::Status FileError(absl::string_view what, const std::string& path) {
  return absl::InternalError(absl::StrCat(
      what, " ", path, ": ", std::strerror(errno), "; check --snapshot_dir"));
}

absl::Status WriteAll(int fd, const std::string& bytes,
                      const std::string& path) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return FileError("cannot write", path);
    }
    done += static_cast<size_t>(n);
  }
  return absl::OkStatus();
}

absl::Status SyncDirectory(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return FileError("cannot open directory", dir);
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return FileError("cannot fsync directory", dir);
  return absl::OkStatus();
}

absl::Status EnsureDirectory(const std::string& dir) {
  if (::mkdir(dir.c_str(), 0700) == 0) {
    // A new directory outlives a power loss only once its entry in the
    // parent directory is on disk.
    std::filesystem::path path(dir);
    if (!path.has_filename()) path = path.parent_path();  // "dir/"
    const std::filesystem::path parent = path.parent_path();
    const absl::Status synced =
        SyncDirectory(parent.empty() ? "." : parent.string());
    // The snapshots can still be written: say so rather than fail them.
    if (!synced.ok()) {
      Log(LogLevel::kWarning, "snapshot_dir_not_synced",
          {{"dir", dir}, {"error", synced.ToString()}});
    }
    return absl::OkStatus();
  }
  if (errno == EEXIST) return absl::OkStatus();
  return FileError("cannot create directory", dir);
}

// Reads exactly `size` bytes; false at a clean end of file before any.
absl::StatusOr<bool> ReadExactly(int fd, char* data, size_t size,
                                 const std::string& path) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(fd, data + done, size - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return FileError("cannot read", path);
    }
    if (n == 0) {
      if (done == 0) return false;
      return absl::DataLossError(absl::StrCat(
          "snapshot file ", path, " ends inside a record; it is truncated"));
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

bool HasSuffix(const std::string& name, absl::string_view suffix) {
  return absl::EndsWith(name, suffix);
}

}  // namespace

SnapshotDirectoryLock& SnapshotDirectoryLock::operator=(
    SnapshotDirectoryLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

SnapshotDirectoryLock::~SnapshotDirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

absl::StatusOr<SnapshotDirectoryLock> PrepareSnapshotDirectory(
    const std::string& dir) {
  ATTN_RETURN_IF_ERROR(EnsureDirectory(dir));
  const std::string lock_path = absl::StrCat(dir, "/.lock");
  const int lock_fd =
      ::open(lock_path.c_str(), O_RDONLY | O_CREAT | O_CLOEXEC, 0600);
  if (lock_fd < 0) return FileError("cannot open", lock_path);
  SnapshotDirectoryLock lock(lock_fd);
  if (::flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat(
          "another process holds ", lock_path,
          ": each server needs a --snapshot_dir of its own (two would "
          "both restore every session)"));
    }
    return FileError("cannot lock", lock_path);
  }
  const std::string probe = absl::StrCat(dir, "/.probe", kTemporarySuffix);
  const int fd =
      ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return FileError("cannot create", probe);
  absl::Cleanup remove = [&] { ::unlink(probe.c_str()); };
  const absl::Status written = WriteAll(fd, "probe", probe);
  const absl::Status synced =
      ::fsync(fd) == 0 ? absl::OkStatus() : FileError("cannot fsync", probe);
  ::close(fd);
  ATTN_RETURN_IF_ERROR(written);
  ATTN_RETURN_IF_ERROR(synced);
  return lock;
}

absl::StatusOr<int64_t> SaveSession(AttentionEngine& engine,
                                    const std::string& id,
                                    const std::string& path,
                                    absl::Time deadline, const Tenant& owner,
                                    absl::Time wait_until) {
  ATTN_ASSIGN_OR_RETURN(
      std::unique_ptr<SessionExport> session_export,
      engine.ExportSession(id, owner, std::min(wait_until, deadline)));
  const std::string temporary = absl::StrCat(path, kTemporarySuffix);
  const int fd =
      ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return FileError("cannot create", temporary);
  bool keep = false;
  absl::Cleanup close_file = [&] {
    ::close(fd);
    if (!keep) ::unlink(temporary.c_str());
  };
  std::string buffer;
  std::string serialized;
  ATTN_ASSIGN_OR_RETURN(
      const int64_t bytes,
      WriteSessionExport(
          *session_export,
          [&](v1::SessionChunk& record) -> absl::Status {
            if (absl::Now() > deadline) {
              return absl::DeadlineExceededError(
                  "the snapshot ran out of --drain_timeout");
            }
            record.SerializeToString(&serialized);
            const uint32_t size = static_cast<uint32_t>(serialized.size());
            char prefix[4];
            for (int i = 0; i < 4; ++i)
              prefix[i] = static_cast<char>(size >> (8 * i));
            buffer.append(prefix, 4);
            buffer.append(serialized);
            if (buffer.size() >= kWriteBufferBytes) {
              ATTN_RETURN_IF_ERROR(WriteAll(fd, buffer, temporary));
              buffer.clear();
            }
            return absl::OkStatus();
          },
          kMaxFileRecordBytes));
  ATTN_RETURN_IF_ERROR(WriteAll(fd, buffer, temporary));
  if (::fsync(fd) != 0) return FileError("cannot fsync", temporary);
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    return FileError("cannot rename to", path);
  }
  keep = true;
  return bytes;
}

namespace {

// Adds one session's save to `result` (logging a failure).
void Count(const std::string& id, const absl::StatusOr<int64_t>& bytes,
           SaveAllResult& result) {
  if (bytes.ok()) {
    ++result.written;
    result.bytes += *bytes;
  } else if (bytes.status().code() != absl::StatusCode::kNotFound) {
    // A session deleted or expired meanwhile is simply gone.
    ++result.failed;
    Log(LogLevel::kError, "snapshot_session_failed",
        {{"session", id}, {"message", bytes.status().message()}});
  }
}

// (id, owner) of every tenant's sessions.
using SessionsToSave = std::vector<std::pair<std::string, Tenant>>;

SessionsToSave ListSessionsToSave(const AttentionEngine& engine) {
  SessionsToSave sessions;
  for (std::string after;;) {
    std::vector<AttentionEngine::SessionOwner> page =
        engine.ListAllSessionOwners(after, 1000);
    if (page.empty()) break;
    for (const auto& session : page) {
      sessions.emplace_back(session.session_id,
                            Tenant{.name = session.owner, .quota = {}});
    }
    after = page.back().session_id;
  }
  return sessions;
}

// Saves `sessions` into `dir`, counting them in `result`: first those no
// call holds, then the others, each waited for until `deadline`.
void SaveInTurn(AttentionEngine& engine, const std::string& dir,
                SessionsToSave sessions, absl::Time deadline,
                SaveAllResult& result) {
  const auto save = [&](const std::string& id, const Tenant& owner,
                        absl::Time wait_until) {
    return SaveSession(engine, id, absl::StrCat(dir, "/", id, kSessionSuffix),
                       deadline, owner, wait_until);
  };
  SessionsToSave busy;
  for (auto& [id, owner] : sessions) {
    absl::StatusOr<int64_t> bytes = save(id, owner, absl::Now());
    if (IsSessionBusy(bytes.status())) {
      busy.emplace_back(std::move(id), std::move(owner));
    } else {
      Count(id, bytes, result);
    }
  }
  for (const auto& [id, owner] : busy) {
    absl::StatusOr<int64_t> bytes = save(id, owner, deadline);
    if (IsSessionBusy(bytes.status())) {
      bytes = absl::DeadlineExceededError(
          "a call on the session still ran when the snapshot ran out of "
          "--drain_timeout");
    }
    Count(id, bytes, result);
  }
}

}  // namespace

SaveAllResult SaveAllSessions(AttentionEngine& engine, const std::string& dir,
                              absl::Time deadline) {
  const absl::Time start = absl::Now();
  SaveAllResult result;
  SessionsToSave sessions = ListSessionsToSave(engine);
  if (absl::Status status = EnsureDirectory(dir); !status.ok()) {
    Log(LogLevel::kError, "snapshot_failed",
        {{"dir", dir},
         {"sessions", static_cast<int64_t>(sessions.size())},
         {"message", status.message()}});
    result.failed = static_cast<int64_t>(sessions.size());
    result.duration = absl::Now() - start;
    return result;
  }
  SaveInTurn(engine, dir, std::move(sessions), deadline, result);
  if (absl::Status status = SyncDirectory(dir); !status.ok()) {
    Log(LogLevel::kError, "snapshot_failed",
        {{"dir", dir}, {"message", status.message()}});
  }
  result.duration = absl::Now() - start;
  return result;
}

namespace {

// A snapshot file's records, read one at a time, each bounded as a request
// of its size is.
class SnapshotFileReader {
 public:
  // Opens `path`, not following a link nor waiting on a FIFO: only a
  // regular file of the directory's own is a snapshot (PERMISSION_DENIED).
  static absl::StatusOr<std::unique_ptr<SnapshotFileReader>> Open(
      const std::string& path) {
    const int fd =
        ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
    if (fd < 0 && errno == ELOOP) {
      return absl::PermissionDeniedError(
          absl::StrCat(path, " is a symbolic link, not a snapshot file"));
    }
    if (fd < 0) return FileError("cannot open", path);
    auto reader =
        std::unique_ptr<SnapshotFileReader>(new SnapshotFileReader(fd, path));
    struct stat file;
    if (::fstat(fd, &file) != 0) return FileError("cannot stat", path);
    if (!S_ISREG(file.st_mode)) {
      return absl::PermissionDeniedError(
          absl::StrCat(path, " is not a regular file, not a snapshot file"));
    }
    return reader;
  }
  ~SnapshotFileReader() { ::close(fd_); }

  // The next record into `record`; false at the end of the file.
  absl::StatusOr<bool> Read(v1::SessionChunk* record) {
    unsigned char prefix[4];
    ATTN_ASSIGN_OR_RETURN(
        const bool more,
        ReadExactly(fd_, reinterpret_cast<char*>(prefix), 4, path_));
    if (!more) return false;
    const uint32_t size = prefix[0] | (prefix[1] << 8) | (prefix[2] << 16) |
                          (static_cast<uint32_t>(prefix[3]) << 24);
    if (size > kMaxFileRecordBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("snapshot file ", path_, " has a record of ", size,
                       " bytes, over the limit of ", kMaxFileRecordBytes));
    }
    bytes_.resize(size);
    ATTN_ASSIGN_OR_RETURN(const bool whole,
                          ReadExactly(fd_, bytes_.data(), size, path_));
    if (!whole && size > 0) {
      return absl::DataLossError(
          absl::StrCat("snapshot file ", path_, " ends inside a record"));
    }
    // A record may take no more memory than a request of its size (64 MiB
    // of empty sub-messages would parse into gigabytes).
    if (const absl::Status budget =
            proto::CheckParseBudget(bytes_, *v1::SessionChunk::descriptor());
        !budget.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("snapshot file ", path_,
                       " has a record the server refuses to parse (",
                       budget.message(), ")"));
    }
    if (!record->ParseFromString(bytes_)) {
      return absl::InvalidArgumentError(
          absl::StrCat("snapshot file ", path_,
                       " holds a record that is not a SessionChunk"));
    }
    return true;
  }

  std::function<absl::StatusOr<bool>(v1::SessionChunk*)> AsSource() {
    return [this](v1::SessionChunk* record) { return Read(record); };
  }

 private:
  SnapshotFileReader(int fd, std::string path)
      : fd_(fd), path_(std::move(path)) {}

  const int fd_;
  const std::string path_;
  std::string bytes_;  // the record being read
};

}  // namespace

absl::StatusOr<int64_t> RestoreSession(AttentionEngine& engine,
                                       const std::string& path,
                                       const OwnerQuota& owner_quota) {
  ATTN_ASSIGN_OR_RETURN(std::unique_ptr<SnapshotFileReader> file,
                        SnapshotFileReader::Open(path));
  ImportOptions options;
  options.keep_session_id = true;
  options.keep_idle_deadline = true;
  options.keep_owner = true;
  options.owner_quota = owner_quota;
  ATTN_ASSIGN_OR_RETURN(
      ReadImport read,
      ReadSessionImport(engine, options, KeepSessionId::kAllowed,
                        std::numeric_limits<int64_t>::max(), file->AsSource()));
  ATTN_RETURN_IF_ERROR(read.Commit().status());
  return read.kv_bytes;
}

namespace {

// What becomes of a file whose restore failed with `code`: corrupt files,
// entries that are no snapshot file (PERMISSION_DENIED) and ids already
// taken are moved aside (never restored again); a file that may restore
// later is kept for the next start, so that no session is lost to a
// passing condition (a full pool, an I/O error; forks, which share their
// blocks while live, are restored one whole copy each) or to this start's
// configuration (a spec over --max_session_tokens, blocks too small, a
// session kind the backend does not serve: FAILED_PRECONDITION), which a
// later start may not share.
enum class Disposition { kCorrupt, kRejected, kKept };

Disposition DispositionOf(absl::StatusCode code) {
  switch (code) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kDataLoss:
      return Disposition::kCorrupt;
    case absl::StatusCode::kAlreadyExists:
    case absl::StatusCode::kPermissionDenied:
    case absl::StatusCode::kOutOfRange:
      return Disposition::kRejected;
    default:
      return Disposition::kKept;
  }
}

// Why the file at `path` was not restored: `status`, the restore's
// failure, unless that would keep the file and the file fails its own
// checksum. The import checks the header before the data, so a header
// corrupted into a spec or a size this server cannot take now fails as a
// valid file would, and would be kept and reported at every start.
absl::Status WhyNotRestored(const std::string& path, absl::Status status) {
  if (DispositionOf(status.code()) != Disposition::kKept) return status;
  absl::StatusOr<std::unique_ptr<SnapshotFileReader>> file =
      SnapshotFileReader::Open(path);
  if (!file.ok()) return status;
  absl::Status checked = CheckSnapshotRecords((*file)->AsSource());
  if (checked.ok() || DispositionOf(checked.code()) != Disposition::kCorrupt) {
    return status;  // valid, or unreadable now (an I/O error)
  }
  return checked;
}

void PutAsideOrKeep(const std::string& path, const absl::Status& status,
                    RestoreAllResult& result) {
  const char* suffix = nullptr;
  const char* event = "snapshot_kept";
  int64_t* count = &result.kept;
  switch (DispositionOf(status.code())) {
    case Disposition::kCorrupt:
      suffix = ".corrupt";
      event = "snapshot_corrupt";
      count = &result.corrupt;
      break;
    case Disposition::kRejected:
      suffix = ".rejected";
      event = "snapshot_rejected";
      count = &result.rejected;
      break;
    case Disposition::kKept:
      break;
  }
  ++*count;
  std::string moved_to = "(kept for the next start)";
  if (suffix != nullptr) {
    moved_to = absl::StrCat(path, suffix);
    if (::rename(path.c_str(), moved_to.c_str()) != 0) {
      // Still there: the next start reports it again.
      moved_to = absl::StrCat("(not moved: ", std::strerror(errno), ")");
    }
  }
  Log(LogLevel::kError, event,
      {{"file", path},
       {"moved_to", moved_to},
       {"code", absl::StatusCodeToString(status.code())},
       {"message", status.message()}});
}

}  // namespace

RestoreAllResult RestoreAllSessions(AttentionEngine& engine,
                                    const std::string& dir,
                                    const std::function<bool()>& stop_requested,
                                    const OwnerQuota& owner_quota) {
  RestoreAllResult result;
  std::vector<std::string> names;
  if (DIR* handle = ::opendir(dir.c_str()); handle != nullptr) {
    while (const dirent* entry = ::readdir(handle))
      names.push_back(entry->d_name);
    ::closedir(handle);
  } else {
    Log(LogLevel::kError, "restore_failed",
        {{"dir", dir}, {"message", std::strerror(errno)}});
    return result;
  }
  const auto stopped = [&] { return stop_requested && stop_requested(); };
  // Restores `path` (under the owners' quotas when `quota` is set); false
  // when that failed RESOURCE_EXHAUSTED and `last_try` is false.
  const auto restore = [&](const std::string& path, const OwnerQuota& quota,
                           bool last_try) {
    absl::StatusOr<int64_t> bytes = RestoreSession(engine, path, quota);
    if (bytes.ok()) {
      ++result.restored;
      result.bytes += *bytes;
      result.files.push_back(path);
    } else if (!last_try && absl::IsResourceExhausted(bytes.status())) {
      return false;
    } else {
      PutAsideOrKeep(path, WhyNotRestored(path, bytes.status()), result);
    }
    return true;
  };
  std::vector<std::string> past_quota;  // the second round's
  for (const std::string& name : names) {
    if (stopped()) return result;
    const std::string path = absl::StrCat(dir, "/", name);
    if (HasSuffix(name, absl::StrCat(kSessionSuffix, kTemporarySuffix))) {
      // A snapshot interrupted before its rename: never complete.
      ::unlink(path.c_str());
      Log(LogLevel::kWarning, "snapshot_partial_removed", {{"file", path}});
      continue;
    }
    if (!HasSuffix(name, kSessionSuffix)) continue;
    if (!restore(path, owner_quota, /*last_try=*/!owner_quota)) {
      past_quota.push_back(path);
    }
  }
  for (const std::string& path : past_quota) {
    if (stopped()) break;
    restore(path, nullptr, /*last_try=*/true);
  }
  return result;
}

void RemoveRestoredFiles(const std::string& dir,
                         const std::vector<std::string>& files) {
  if (files.empty()) return;
  for (const std::string& path : files) {
    if (::unlink(path.c_str()) != 0) {
      Log(LogLevel::kError, "restored_file_not_removed",
          {{"file", path}, {"message", std::strerror(errno)}});
    }
  }
  if (absl::Status status = SyncDirectory(dir); !status.ok()) {
    Log(LogLevel::kWarning, "restore_sync_failed",
        {{"dir", dir}, {"message", status.message()}});
  }
}

}  // namespace attention::server
