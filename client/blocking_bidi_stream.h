// BlockingBidiStream: a bidirectional gRPC stream with blocking Write /
// Read / WritesDone / Finish, run on gRPC's callback API.
//
// Why not the synchronous API: there, Write blocks until the transport has
// taken the message and Read until the reply is there, each on a completion
// queue the calling thread polls, so a step (write, then read) puts the
// thread to sleep and wakes it up twice whenever the connection is busy
// (many streams share one HTTP/2 connection, and batched replies arrive in
// bursts). Here a Write copies the request into a queue and returns; gRPC's
// threads send it (one write in flight, in order), and the caller sleeps
// only in Read, until its reply has arrived: one wake-up per step.
//
// Lifetime: the call is bound when the stream is constructed (`bind`, e.g.
// `stub->async()->Decode(context, reactor)`) and started at once. A hold
// (ClientBidiReactor::AddHold) keeps gRPC from finishing the call while the
// caller may still start operations; it is released once the stream has
// ended (a read failed: the server finished it, or it was cancelled or the
// connection broke) or is destroyed. The destructor cancels a stream that
// was not finished and waits until gRPC is done with it.
//
// Thread-safety: one thread may write while another reads (as with the
// synchronous API); Finish and the destructor must not race with either.
#ifndef ATTENTION_CLIENT_BLOCKING_BIDI_STREAM_H_
#define ATTENTION_CLIENT_BLOCKING_BIDI_STREAM_H_

#include <grpcpp/client_context.h>
#include <grpcpp/support/client_callback.h>
#include <grpcpp/support/status.h>

#include <deque>
#include <optional>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/synchronization/mutex.h"

namespace attention::client {

template <class Request, class Response>
class BlockingBidiStream final
    : public grpc::ClientBidiReactor<Request, Response> {
  using Reactor = grpc::ClientBidiReactor<Request, Response>;

 public:
  // `context` (with its metadata set) must outlive the stream. `bind`
  // binds the call to this reactor and must not start it.
  BlockingBidiStream(
      grpc::ClientContext* context,
      absl::FunctionRef<void(grpc::ClientContext*, Reactor*)> bind)
      : context_(context) {
    bind(context, this);
    Reactor::AddHold();
    Reactor::StartCall();
  }
  ~BlockingBidiStream() override {
    bool cancel = false;
    bool release = false;
    {
      absl::MutexLock lock(&mu_);
      cancel = !done_;
      release = TakeHoldLocked();
    }
    if (cancel) context_->TryCancel();
    if (release) Reactor::RemoveHold();
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
  }

  BlockingBidiStream(const BlockingBidiStream&) = delete;
  BlockingBidiStream& operator=(const BlockingBidiStream&) = delete;

  // Queues a copy of `request` to be sent after the earlier ones; does not
  // wait for the transport. False when the stream is known to have ended, a
  // write failed or WritesDone was called (the request is then dropped).
  bool Write(const Request& request) {
    const Request* start = nullptr;
    {
      absl::MutexLock lock(&mu_);
      if (ended_ || write_failed_ || writes_done_) return false;
      writes_.push_back(request);
      if (!write_in_flight_) start = StartNextWriteLocked();
    }
    if (start != nullptr) Reactor::StartWrite(start);
    return true;
  }

  // The next reply, into `*response`; false once the stream has ended
  // (Status() then waits for its status).
  bool Read(Response* response) {
    bool start = false;
    {
      absl::MutexLock lock(&mu_);
      if (!read_ready_ && !read_in_flight_ && !ended_) {
        read_in_flight_ = true;
        start = true;
      }
    }
    if (start) Reactor::StartRead(&incoming_);
    absl::MutexLock lock(&mu_);
    auto answered = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return read_ready_ || ended_;
    };
    mu_.Await(absl::Condition(&answered));
    if (!read_ready_) return false;
    read_ready_ = false;
    *response = std::move(incoming_);
    return true;
  }

  // Write(request) then Read(response), for a caller that takes both
  // roles. When no earlier write is queued, `request` is sent from the
  // caller's object instead of a copy, and Step returns only once gRPC is
  // done with it (its write completes before the reply can be read, so
  // this costs no wait). False as Read.
  bool Step(const Request& request, Response* response) {
    bool direct = false;
    {
      absl::MutexLock lock(&mu_);
      if (!ended_ && !write_failed_ && !writes_done_ && !write_in_flight_ &&
          writes_.empty()) {
        write_in_flight_ = true;
        direct_write_ = true;
        direct = true;
      }
    }
    if (!direct) {
      // A failed Write means the stream is over; Read then says so.
      Write(request);
      return Read(response);
    }
    Reactor::StartWrite(&request);
    const bool read = Read(response);
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](bool* direct_write) { return !*direct_write; }, &direct_write_));
    return read;
  }

  // No more writes: half-closes once the queued ones are sent.
  void WritesDone() {
    bool start = false;
    {
      absl::MutexLock lock(&mu_);
      if (writes_done_ || write_failed_ || ended_) return;
      writes_done_ = true;
      start = !write_in_flight_;
      if (start) StartWritesDoneLocked();
    }
    if (start) Reactor::StartWritesDone();
  }

  // The call's status once it has ended; waits for it. REQUIRES: the
  // stream has ended (Read returned false).
  grpc::Status Status() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(&done_));
    return status_;
  }

  // Half-closes, discards the replies not read, and returns the call's
  // status.
  grpc::Status Finish() {
    WritesDone();
    Response discarded;
    while (Read(&discarded)) {
    }
    return Status();
  }

  void OnWriteDone(bool ok) override {
    const Request* next = nullptr;
    bool writes_done = false;
    bool release = false;
    {
      absl::MutexLock lock(&mu_);
      if (direct_write_) {
        direct_write_ = false;  // Step's request: not in writes_
      } else {
        writes_.pop_front();
      }
      write_in_flight_ = false;
      // A failed write ends the writing only: replies that arrived before
      // the server finished the call can still be read.
      if (!ok) write_failed_ = true;
      if (!ok || ended_) {
        writes_.clear();
      } else if (!writes_.empty()) {
        next = StartNextWriteLocked();
      } else if (writes_done_) {
        StartWritesDoneLocked();
        writes_done = true;
      }
      release = ReleasableLocked();
    }
    if (next != nullptr) Reactor::StartWrite(next);
    if (writes_done) Reactor::StartWritesDone();
    if (release) Reactor::RemoveHold();
  }

  void OnWritesDoneDone(bool /*ok*/) override {
    bool release = false;
    {
      absl::MutexLock lock(&mu_);
      write_in_flight_ = false;
      release = ReleasableLocked();
    }
    if (release) Reactor::RemoveHold();
  }

  void OnReadDone(bool ok) override {
    bool release = false;
    {
      absl::MutexLock lock(&mu_);
      read_in_flight_ = false;
      if (ok) {
        read_ready_ = true;
      } else {
        // The call is over (finished by the server, cancelled or broken):
        // nothing starts any more, and gRPC may deliver its status.
        ended_ = true;
        release = ReleasableLocked();
      }
    }
    if (release) Reactor::RemoveHold();
  }

  void OnDone(const grpc::Status& status) override {
    absl::MutexLock lock(&mu_);
    status_ = status;
    done_ = true;
  }

 private:
  // Marks the front of writes_ in flight and returns it.
  const Request* StartNextWriteLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    write_in_flight_ = true;
    return &writes_.front();
  }
  // Marks the half-close in flight (it counts as a write).
  void StartWritesDoneLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    write_in_flight_ = true;
  }
  // Once the call is over and no write is in flight (or about to be
  // started by a thread that decided so under mu_), the hold goes: after
  // that no operation may start. True when the caller releases it.
  bool ReleasableLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return ended_ && !write_in_flight_ && TakeHoldLocked();
  }
  // True the first time: the caller releases the hold.
  bool TakeHoldLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (hold_released_) return false;
    hold_released_ = true;
    return true;
  }

  grpc::ClientContext* const context_;
  absl::Mutex mu_;
  // Queued writes; the front one is in flight when write_in_flight_ (and
  // not writes_done_; then the half-close is). References to deque elements
  // survive push_back.
  std::deque<Request> writes_ ABSL_GUARDED_BY(mu_);
  bool write_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  // The write in flight is Step's request (the caller's object).
  bool direct_write_ ABSL_GUARDED_BY(mu_) = false;
  bool writes_done_ ABSL_GUARDED_BY(mu_) = false;
  // The reply being read (written by gRPC while read_in_flight_).
  Response incoming_;
  bool read_in_flight_ ABSL_GUARDED_BY(mu_) = false;
  bool read_ready_ ABSL_GUARDED_BY(mu_) = false;
  bool write_failed_ ABSL_GUARDED_BY(mu_) = false;
  // A read failed: the call is over.
  bool ended_ ABSL_GUARDED_BY(mu_) = false;
  bool hold_released_ ABSL_GUARDED_BY(mu_) = false;
  bool done_ ABSL_GUARDED_BY(mu_) = false;
  grpc::Status status_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attention::client

#endif  // ATTENTION_CLIENT_BLOCKING_BIDI_STREAM_H_
