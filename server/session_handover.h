// SessionHandover: what a draining replica does with its sessions when
// other replicas are SERVING (--peers): it moves each one to the peer with
// the most free KV memory instead of dropping it.
//
// Design: one session at a time, for every tenant's sessions:
//   1. the SERVING peers as probed (Peers::Serving) at most a second ago,
//      or again after every peer refused a session: each session goes to
//      the peer with the most free KV memory then, and a drain of many
//      sessions does not resolve and probe every peer once per session;
//   2. the session is sealed here (SessionManager::Seal): calls on it wait,
//      and the seal waits until none runs, so its state is at rest;
//   3. it is exported into an ImportSession call on the peer, keeping its
//      id (keep_session_id) and its tenant (the call carries
//      kHandoverMetadata, which a peer honours from a peer identity only;
//      see AttentionServiceImpl::ImportSession);
//   4. on success it is deleted here and remembered as moved
//      (SessionSeal::Commit): the waiting calls and later ones get the
//      redirect; on a refusal the next peer is tried, and when every peer
//      refused it is unsealed (the waiting calls run here) and tried once
//      more at the end.
// While a session is sealed, decode steps on it fail at once with the
// moving marker (SessionMovingError: nothing applied, the client re-sends
// once the move ends), so the engine batches of other sessions never wait
// for it; its other calls wait.
// A session is thus never live on two replicas: it is sealed here before
// the peer accepts calls on it. An error the peer's import handler itself
// answered (its trailers carry kImportRefusedMetadata) created nothing,
// whatever its code. When an import's answer leaves a doubt (no such
// trailer: the stream broke or was cancelled, timed out or failed oddly
// after the whole snapshot was sent: the peer may have created the
// session) the same peer is asked again; the peer then answers ALREADY_EXISTS
// for its id if the earlier attempt created it (also when it has begun to
// drain meanwhile), which counts as moved. Only
// then: without such an attempt under the same seal, ALREADY_EXISTS is a
// refusal (the peer holds another copy, e.g. one a client imported keeping the
// id, or one an earlier seal left there before the session changed again).
// Still in doubt, a session counts as moved unless both answers were broken
// connections (what a peer that started to drain gives at once); a first
// answer that may mean the peer created it counts even when the second
// attempt is refused outright, cut or cannot be exported again, unless the
// peer said in that attempt that it looked the id up and found no session
// of it (kImportIdCheckedMetadata, sent right after the header's checks,
// which a second attempt cut short waits for before it ends the call): the
// session then goes on to the next peer or stays here.
// The hand-over's time has two ends (HandoverDeadlines): sessions are
// started and their records sent until the first; an import whose records
// all went before it may still be answered until the second, so that the
// import in flight when the time runs out ends with the peer's answer, not
// with a doubt (a deadline the peer may meet before or after it created
// the session: counted as moved, the session could be on neither replica).
// An import that ends in doubt at the end all the same (cut by the end on
// a loaded peer, or its connection broken as the end came) is asked again
// once, with the reserve again to send and to answer, past the hand-over's
// end.
// When no peer serves but one did not answer its probe in time (busy, or
// paused), the hand-over probes again every second until one serves or its
// time is up, instead of giving up on every session at once.
// Sessions that could not
// be moved (no SERVING peer, every peer refused, the export refused, calls
// that kept it busy) stay here; the drain then snapshots them when
// --snapshot_dir is set.
//
// Forks share KV blocks here; each is exported whole, so the peer holds
// one copy per fork.
//
// Thread-safety: HandOverAll runs once, on the drain's thread.
#ifndef ATTENTION_SERVER_SESSION_HANDOVER_H_
#define ATTENTION_SERVER_SESSION_HANDOVER_H_

#include <grpcpp/support/status.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/engine.h"
#include "server/metrics.h"
#include "server/peers.h"
#include "server/session_transfer.h"

namespace attention::server {

struct HandoverResult {
  int64_t sent = 0;    // moved to a peer
  int64_t failed = 0;  // tried and left here (or, outcome unknown, dropped)
  int64_t left = 0;    // not tried: no SERVING peer, or out of time
  absl::Duration duration;
};

// When a hand-over that must end at `end` stops sending: `end` less a
// reserve for the peer's answer to the last import (an eighth of the
// hand-over's time, at least 250 ms or half of it, at most 2 s).
struct HandoverDeadlines {
  static HandoverDeadlines For(absl::Time start, absl::Time end);
  // The deadlines of one more attempt at `now`, when the import in flight
  // at the end was cut by `answer` and its outcome is unknown: the reserve
  // again to send, and again to answer (taken from the snapshot's time).
  HandoverDeadlines Settling(absl::Time now) const;
  absl::Time send;    // no session started, no record sent after it
  absl::Time answer;  // the end: imports are answered by then
  absl::Duration reserve;
};

class SessionHandover {
 public:
  // Every pointer must outlive the handover; `metrics` may be null.
  SessionHandover(AttentionEngine* engine, Peers* peers, ServerMetrics* metrics,
                  std::string self_address);

  // Moves every session it can before `deadline` (see above; it stops
  // sending at HandoverDeadlines::For(now, deadline).send).
  HandoverResult HandOverAll(absl::Time deadline);

  // What a failed import may have left on the peer.
  enum class Doubt {
    kNone,     // a refusal: the peer created nothing
    kBroken,   // the connection failed, the call was cancelled, or gRPC
               // itself refused a message, after the whole snapshot was
               // sent (the peer may have created it, or refused it):
               // asking again settles it
    kUnknown,  // the peer may have created it (timed out, or an error no
               // import refusal gives)
  };
  // The doubt an import's end leaves: `status` its status, `all_sent`
  // whether every record was written, `refused` whether the peer's import
  // handler said it refused (its trailer).
  static Doubt DoubtOf(const grpc::Status& status, bool all_sent, bool refused);

  // What a move to one peer does after its attempt `attempt` (0, then 1)
  // ended in doubt `doubt` (not kNone), its first attempt's being `first`.
  struct AfterDoubt {
    bool ask_again = false;  // the same peer, once more...
    bool settle = false;     // ...in the extension past the time's end
    bool moved = false;      // not asked again: counted as moved
  };
  // The first doubt, of either kind, is asked again, past the end of the
  // time when it is up (HandoverDeadlines::Settling); after the second,
  // the session counts as moved unless both answers were kBroken.
  static AfterDoubt NextAfterDoubt(int attempt, Doubt first, Doubt doubt,
                                   bool out_of_time);

 private:
  // kFailed may succeed later (busy, or every peer refused); kRefused will
  // not (the export is refused, or the outcome is unknown).
  enum class Outcome { kSent, kFailed, kRefused, kNoPeer, kGone };
  // Moves session `id`: seals it, tries the peers in order.
  Outcome HandOver(const std::string& id, const HandoverDeadlines& deadlines);
  // Addresses of the peers whose import of the current seal left a doubt.
  // Per seal: after a seal is released the session changes again, so an
  // older copy a peer may hold is no longer it.
  using InDoubt = absl::flat_hash_set<std::string>;
  // Imports sealed session `seal` into `peer` (first from
  // `session_export`, of `seal`), asking again once when the answer leaves
  // a doubt (a peer that holds the session answers ALREADY_EXISTS). OK
  // when the peer holds it now; otherwise `*moved` says whether to count it
  // as moved all the same (a kUnknown answer, even if the second attempt
  // was refused or its re-export failed: never live on two replicas; not
  // when the second attempt heard that the peer holds no such id).
  absl::Status MoveTo(const Peer& peer, SessionSeal& seal,
                      std::unique_ptr<SessionExport> session_export,
                      const HandoverDeadlines& deadlines, InDoubt* in_doubt,
                      bool* moved);
  // One ImportSession call carrying `session_export` (of a sealed session)
  // to `peer`. OK when the peer holds the session now (also when an
  // attempt of this seal left it there: ALREADY_EXISTS from a peer in
  // `*in_doubt`); `*doubt` qualifies a failure, which adds the peer to
  // `*in_doubt` unless it is kNone; a kNone failure after the peer said it
  // looked the id up (kImportIdCheckedMetadata) takes it out.
  absl::Status SendTo(const Peer& peer, SessionExport& session_export,
                      const HandoverDeadlines& deadlines, InDoubt* in_doubt,
                      Doubt* doubt);

  // The SERVING peers, probed again (looked up and probed until `deadline`,
  // see Peers::Serving) when the last probe is a second old or `refresh`
  // is set.
  const std::vector<Peer>& ServingPeers(bool refresh, absl::Time deadline);

  AttentionEngine* const engine_;
  Peers* const peers_;
  ServerMetrics* const metrics_;
  const std::string self_address_;
  std::vector<Peer> serving_;
  bool unanswered_ = false;  // a peer did not answer the last probe in time
  absl::Time probed_ = absl::InfinitePast();
  bool refresh_ = false;  // every peer refused the last session
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_SESSION_HANDOVER_H_
