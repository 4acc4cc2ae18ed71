// A client for a fleet of attention-server replicas that behaves like one
// large server (attention.proto, "Fleets"; README, "Fleet").
//
//   auto cluster = attention::client::ClusterClient::Open(
//       "attention-server-headless.ns.svc.cluster.local:50051");
//   auto info = (*cluster)->CreateSession(spec);       // placed on a replica
//   auto result = (*cluster)->Prefill(request);         // routed to its owner
//   auto stream = (*cluster)->OpenDecodeStream();       // any sessions
//   auto step = stream->Step(decode_request);
//
// Membership. The target is a DNS name resolving to the replicas (the
// headless Service; re-resolved every refresh_interval and after a replica
// fails) or a fixed list "host:port,host:port" (cluster_target.h). The
// client keeps one channel per replica for the calls (and a second one,
// without retries, for probes and look-ups) and probes each replica's
// health and GetServerInfo (draining, free KV) every refresh_interval.
// Replicas it learned of otherwise (a redirect, an older resolution) are
// kept while they answer; one the membership no longer lists that has not
// answered for forget_unreachable_after is forgotten (dialed again if a
// redirect or a remembered owner names it later).
//
// Placement (placement.h). CreateSession goes to a SERVING, non-draining
// replica: the one with the most free KV; near-ties, and sessions given a
// placement_key, by rendezvous hashing, so sessions with one key (one
// user's conversations, one prompt's samples) land together. A replica that
// refuses the session (UNAVAILABLE, RESOURCE_EXHAUSTED) passes it to the
// next; a failure that may come after the replica created it (a connection
// cut, a reply over the receive limit) ends the call instead, so that no
// session is created twice. ForkSession stays on the parent's replica.
//
// Routing. Every call on a session goes to its owner (SessionInfo.owner,
// remembered for the max_known_owners sessions used most recently; a
// session this client has not seen, or has forgotten, is looked up on every
// replica at once). A BatchDecode whose steps live on several replicas is
// split per replica, the parts sent in parallel, and the results put back
// in request order. All-or-nothing then holds PER REPLICA: when one part
// fails, the parts other replicas accepted stay applied (the error says
// which replicas applied their steps).
//
// Moves. A session handed over by a draining replica answers NOT_FOUND
// with its new owner (`attention-session-owner`). The failed call changed
// nothing, so the client records the new owner and sends the call there;
// the caller sees no error. A decode step that reaches the session while it
// is being moved answers UNAVAILABLE with `attention-session-moving` (also
// changing nothing): the client waits for the move's end (GetSession) and
// then sends it to wherever the session is. A Decode stream cut by either,
// or ended by a draining replica as it waited for its next request when the
// drain's time for calls was up (`attention-stream-drained`: the requests
// sent after its last reply were not applied), is reopened where its
// sessions are and its unanswered requests are re-sent in order: results
// continue, bitwise as on one server. While a replica is
// known to drain, the client confirms a session's owner (GetSession,
// answered once the move is over) before sending it anything.
//
// Lost replicas. When the owner is unreachable (UNAVAILABLE) or no longer
// has the session (NOT_FOUND without a new owner: a replacement pod at the
// same address), the client looks for the session on every other replica.
// Found: it is used from then on, and the call is re-sent when that is
// safe (it failed with NOT_FOUND, or it may be repeated: GetSession,
// TruncateSession, DeleteSession, ExportSession before any record, or any
// call that never reached the replica: gRPC found no connection to it, or
// the replica refused it itself, overloaded or draining). An append or a
// fork that failed with UNAVAILABLE otherwise is never re-sent
// (it may have been applied): the error names the replica and where the
// session is now. Not found: NOT_FOUND only when every replica answered
// that it does not hold the session, else UNAVAILABLE naming the replicas
// that did not answer (the session may be on one; an unreachable owner is
// remembered); the client never creates an empty session in a lost one's
// place.
//
// Other errors are the server's, unchanged (code and message).
//
// Thread-safety: ClusterClient is thread-safe. A ClusterDecodeStream is
// not: use each from one thread at a time.
#ifndef ATTENTION_CLIENT_CLUSTER_CLIENT_H_
#define ATTENTION_CLIENT_CLUSTER_CLIENT_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "attention/v1/attention.pb.h"
#include "client/attention_client.h"
#include "client/cluster_target.h"

namespace attention::client {

struct ClusterOptions {
  // Every replica's channel and calls: TLS, token, message limits, call
  // timeout, retries. A zero max_reconnect_backoff becomes 1 s here: a
  // replica restarted on its address is used again within a second.
  ClientOptions client;
  // How often membership is re-resolved and every replica probed.
  // Positive (Open refuses others, INVALID_ARGUMENT), as is probe_timeout.
  absl::Duration refresh_interval = absl::Seconds(2);
  // Deadline of each probe and each look-up of a session on a replica.
  absl::Duration probe_timeout = absl::Seconds(2);
  // How long a fork that the session's draining replica refused (it takes
  // no new sessions) waits for the drain to hand the session over to a
  // peer, asking the replica every 20-500 ms; the fork then goes to the
  // session's new replica. Past it (the drain moves no session: no peer
  // serves) the fork fails with the replica's refusal. A drain hands its
  // sessions over within the first half of its --drain_timeout (12.5 s by
  // default). Zero: no wait. Not negative (Open refuses it).
  absl::Duration move_wait = absl::Seconds(15);
  // Placement ties: replicas whose free KV is within this fraction of the
  // largest capacity of the most free one (PlacementOrder).
  double placement_tie_fraction = 1.0 / 32;
  // Replaces the target's resolution when set (a service registry, a list
  // that changes): returns the replica addresses "host:port".
  std::function<absl::StatusOr<std::vector<std::string>>()> resolver;
  // A replica the membership no longer lists (or never did: known from a
  // redirect or as a session's owner) whose probes have all failed for
  // longer than this is forgotten at the next refresh: look-ups stop asking
  // it, and its channels close once no call or stream uses them. A listed
  // replica is never forgotten, nor one that answers. A forgotten address
  // named again (a redirect, a remembered owner) is dialed anew.
  // absl::InfiniteDuration(): never.
  absl::Duration forget_unreachable_after = absl::Seconds(60);
  // The most sessions whose owner is remembered; past it the one used least
  // recently is forgotten (its next call looks it up on every replica). 0:
  // none is remembered.
  size_t max_known_owners = 1'000'000;
  // The clock of forget_unreachable_after (tests replace it); empty:
  // absl::Now.
  std::function<absl::Time()> now;
};

// One replica as last probed.
struct ReplicaStatus {
  enum class State { kServing, kDraining, kNotServing, kUnreachable };
  // Its identity: ServerInfo.advertise_address once known, else `dialed`.
  std::string address;
  std::string dialed;  // the address the channel connects to
  State state = State::kUnreachable;
  // Listed by the current membership (false: only known as a session's
  // owner or from an older resolution; never placed on, and forgotten once
  // unreachable for forget_unreachable_after).
  bool listed = false;
  v1::ServerInfo info;  // the last GetServerInfo answer
  std::string error;    // why it is unreachable or not serving
};
// "SERVING", "draining", "not-serving", "unreachable".
const char* ReplicaStateName(ReplicaStatus::State state);

class ClusterClient;
// One replica's channels and last probe (defined in cluster_client.cc).
struct ClusterReplica;

// A Decode stream over the fleet: requests on any sessions and layers, one
// result per request, in request order, as DecodeStream. Internally one
// Decode stream per owner replica, opened when first needed; a stream cut
// by a moved-session redirect is reopened at the new owner and its
// unanswered requests re-sent in order (the caller sees nothing).
//
// The first request that fails ends the stream; Read returns its status
// (then Finish does). With one replica the requests before it stay
// applied and none after it are, as with DecodeStream: once a request has
// failed (also one that could not be routed), Write sends nothing more and
// returns false. With several, requests written to OTHER replicas before
// the failure was known may have been applied: GetSession's layer_lengths
// tells. A session's requests reach it in the order written, also when it
// moves while some of them wait. A request sent again after its session
// moved waits behind what the stream sent to the new owner since; when one
// of those ends that replica's stream, the moved request fails ABORTED
// (not applied) naming the request that failed; when the stream ended
// without the server naming a request (a broken connection, a deadline, a
// cancel), with that status and "may or may not have been applied".
class ClusterDecodeStream {
 public:
  ~ClusterDecodeStream();  // cancels whatever is still open
  ClusterDecodeStream(const ClusterDecodeStream&) = delete;
  ClusterDecodeStream& operator=(const ClusterDecodeStream&) = delete;

  // Sends a request to its session's owner. False once the stream has
  // ended (Read says why).
  bool Write(const v1::DecodeRequest& request);
  // The result of the oldest request not yet read. FAILED_PRECONDITION
  // when every written request has been read; after the end, the error
  // that ended the stream, or OUT_OF_RANGE after WritesDone. An error
  // from a replica's stream names the request as this stream counts its
  // writes ("requests[i]: ", from 0), whichever replica it went to.
  absl::StatusOr<v1::AttentionResult> Read();
  // Write then Read.
  absl::StatusOr<v1::AttentionResult> Step(const v1::DecodeRequest& request);
  // No more requests follow (Read still returns the pending results).
  void WritesDone();
  // Reads (and drops) the results still pending, so that every written
  // request is applied or reported, then closes: OK or the first error.
  // Idempotent.
  absl::Status Finish();

 private:
  friend class ClusterClient;
  struct Entry;
  struct Lane;
  explicit ClusterDecodeStream(ClusterClient* cluster);

  // Routes `entry` to its owner's lane (opening it, or opening it again
  // when its stream ended with nothing of this stream's in it), or to the
  // lane where an earlier request of its session still waits, so that it
  // never overtakes it; on a routing error the entry gets that error as its
  // result.
  void Dispatch(Entry* entry);
  // Dispatches `entries` in order; those written after a request that
  // failed are failed unsent (the stream ends at that one).
  void DispatchAll(const std::deque<Entry*>& entries);
  // `entry` ends with `status`: the stream takes no more requests.
  void Fail(Entry* entry, absl::Status status);
  // Half-closes the lanes that wait for nothing on replicas known to
  // drain, so that the stream does not hold those replicas' drains up.
  void CloseIdleLanes();
  // Reads the next result of `lane` into its oldest unanswered entry, or
  // handles the lane's end (re-dispatch after a move, else the error).
  void Pump(Lane* lane);
  // The lane where a request of `session_id` waits for its result, if any.
  Lane* LaneWaitingOn(const std::string& session_id) const;
  // The lane of `replica`, opened when missing.
  Lane* LaneFor(const std::shared_ptr<ClusterReplica>& replica);

  static constexpr int64_t kNoFailure = std::numeric_limits<int64_t>::max();

  ClusterClient* cluster_;
  std::deque<std::unique_ptr<Entry>> entries_;  // written, not yet read
  std::map<const ClusterReplica*, std::unique_ptr<Lane>> lanes_;
  // Half-closed by CloseIdleLanes; finished by Finish, or cancelled when
  // a lane to their replica opens again.
  std::vector<std::unique_ptr<Lane>> closing_;
  int64_t written_ = 0;  // requests written so far
  // The write index of the first request that failed: nothing written
  // after it is sent (and no more is taken); kNoFailure while none has.
  int64_t first_failed_ = kNoFailure;
  bool writes_done_ = false;
  std::optional<absl::Status> final_status_;
};

class ClusterClient {
 public:
  // Parses `target` (cluster_target.h; INVALID_ARGUMENT when malformed),
  // resolves and probes the replicas once, and starts refreshing them in
  // the background. Unreachable replicas are no error here: calls report
  // them. INVALID_ARGUMENT also for unreadable TLS files.
  static absl::StatusOr<std::unique_ptr<ClusterClient>> Open(
      const std::string& target, ClusterOptions options = {});
  ~ClusterClient();  // stops the refresher; outstanding streams must be gone

  ClusterClient(const ClusterClient&) = delete;
  ClusterClient& operator=(const ClusterClient&) = delete;

  // Re-resolves the membership, probes every replica now, then forgets the
  // unlisted replicas unreachable for forget_unreachable_after.
  void Refresh();
  // Every replica as last probed, listed ones first, by address.
  std::vector<ReplicaStatus> Replicas() const;
  // The address of the replica this client believes owns `session_id`
  // (empty when it has not seen the session, or has forgotten it past
  // max_known_owners). Does not count as a use of the session.
  std::string OwnerOf(absl::string_view session_id) const;

  // A new session, placed as above; `placement_key` (optional) groups
  // sessions on one replica. UNAVAILABLE naming every replica's state when
  // none accepts.
  absl::StatusOr<v1::SessionInfo> CreateSession(
      const v1::SessionSpec& spec,
      absl::Duration idle_timeout = absl::ZeroDuration(),
      absl::string_view placement_key = "");
  absl::StatusOr<v1::SessionInfo> GetSession(absl::string_view session_id);
  // The caller's sessions on every listed replica; UNAVAILABLE naming the
  // replicas that did not answer (a partial list would mislead).
  absl::StatusOr<std::vector<v1::SessionInfo>> ListSessions();
  absl::Status DeleteSession(absl::string_view session_id);
  // On the parent's replica.
  absl::StatusOr<v1::SessionInfo> ForkSession(absl::string_view session_id);
  absl::StatusOr<v1::SessionInfo> TruncateSession(absl::string_view session_id,
                                                  int64_t length);
  absl::StatusOr<v1::AttentionResult> Prefill(
      const v1::PrefillRequest& request);
  absl::StatusOr<v1::AttentionResult> DecodeStep(
      const v1::DecodeRequest& request);
  // Results in request order. Steps on several replicas: split per
  // replica, all-or-nothing per replica (see above).
  absl::StatusOr<std::vector<v1::AttentionResult>> BatchDecode(
      const v1::BatchDecodeRequest& request);
  // Stateless: on any accepting replica (the next one on UNAVAILABLE).
  absl::StatusOr<v1::AttentionResult> Attention(
      const v1::AttentionRequest& request);
  // As AttentionClient::ExportSession, from the session's owner.
  absl::Status ExportSession(
      absl::string_view session_id,
      const std::function<absl::Status(const v1::SessionChunk&)>& sink);

  std::unique_ptr<ClusterDecodeStream> OpenDecodeStream();

 private:
  friend class ClusterDecodeStream;
  using Replica = ClusterReplica;
  // Whether a call may be sent again after an UNAVAILABLE.
  enum class Resend { kNever, kIfFoundElsewhere };

  ClusterClient(ClusterTarget target, ClusterOptions options);

  void RefreshLoop();
  bool RefreshDue() const ABSL_SHARED_LOCKS_REQUIRED(refresh_mu_);
  // Wakes the refresher now (after a replica failed).
  void RequestRefresh();
  // Asks `replica` for its health, then (when it answers) its ServerInfo,
  // on gRPC's callback API; records the answers in its status, then calls
  // `done` (on one of gRPC's threads). `replica` must outlive the probe.
  void Probe(Replica& replica, absl::AnyInvocable<void() &&> done);
  void RecordProbe(Replica& replica,
                   const absl::StatusOr<ServingStatus>& health,
                   const absl::StatusOr<v1::ServerInfo>& info);
  // options_.now(), or absl::Now().
  absl::Time Now() const;
  // Drops the unlisted replicas unreachable for forget_unreachable_after.
  void ForgetUnreachable();

  // The replica known by `address` (advertise or dialed address), added
  // (unlisted) when unknown or forgotten.
  std::shared_ptr<Replica> ReplicaAt(const std::string& address);
  // The replica dialed as `address`, else one known by that name (a
  // reachable one first); nullptr when none is.
  std::shared_ptr<Replica> FindLocked(const std::string& address) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  std::string AddressOf(const Replica& replica) const;
  std::vector<std::shared_ptr<Replica>> AllReplicas() const;
  void MarkDraining(const Replica& replica);
  // Whether `replica` is known to drain.
  bool Draining(const Replica& replica) const;
  void MarkUnreachable(const Replica& replica, const absl::Status& why);

  // Remembers (as most recently used) that `address` owns the session,
  // forgetting the least recently used past max_known_owners. An empty
  // address is ignored.
  void SetOwner(absl::string_view session_id, const std::string& address);
  void Learn(const v1::SessionInfo& info, const Replica& replica);
  void Forget(absl::string_view session_id);
  // OwnerOf, counted as a use (most recently used from now).
  std::string UseOwner(absl::string_view session_id);
  void ForgetOwnerLocked(absl::string_view session_id)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The replica to send a call on `session_id` to: its known owner
  // (confirmed first when that replica drains), else found by Locate.
  absl::StatusOr<std::shared_ptr<Replica>> OwnerReplica(
      absl::string_view session_id);
  // Asks `replica` whether it still holds the session: it, the new owner
  // of a moved session, or (not there) the replica Locate finds.
  absl::StatusOr<std::shared_ptr<Replica>> Confirm(
      absl::string_view session_id, const std::shared_ptr<Replica>& replica);
  // Where Locate found a session.
  struct Location {
    // Of the first replica by dialed address that answers either way,
    // itself when it has the session, or the owner its redirect names;
    // nullptr when none does.
    std::shared_ptr<Replica> replica;
    // The replicas that gave no answer either way (unreachable, timed out,
    // overloaded): "host:port, ...", or empty. The session may be on one.
    std::string unanswered;
  };
  // Asks every replica but `skip` for the session, all at once (one probe
  // deadline in all).
  Location Locate(absl::string_view session_id, const Replica* skip);
  // The error for a session that no replica that answered has: NOT_FOUND
  // (`not_found`) when every replica answered, else UNAVAILABLE naming
  // those that did not (the session may be on one; retry once they serve).
  static absl::Status NotOnAnyReplica(absl::string_view session_id,
                                      const Location& location,
                                      absl::Status not_found);
  // Asks `replica` for the session until it no longer holds it (moved by
  // its drain, or gone) or move_wait has passed; the last answer.
  absl::StatusOr<v1::SessionInfo> AwaitMove(absl::string_view session_id,
                                            const Replica& replica);
  // After `status` from `replica` for `method` on the session: the replica
  // to send the call to again, or the error to return.
  absl::StatusOr<std::shared_ptr<Replica>> Recover(absl::string_view session_id,
                                                   absl::string_view method,
                                                   const Replica& replica,
                                                   const absl::Status& status,
                                                   Resend resend);

  // Runs `call` on the session's owner, following moves (Recover).
  template <typename T>
  absl::StatusOr<T> OnSession(
      absl::string_view session_id, absl::string_view method, Resend resend,
      const std::function<absl::StatusOr<T>(AttentionClient&)>& call);
  // BatchDecode of request.steps(i) for i in `steps` into `results`;
  // `moves` redirects followed so far.
  absl::Status BatchOn(const v1::BatchDecodeRequest& request,
                       const std::vector<int>& steps, int moves,
                       std::vector<v1::AttentionResult>* results);

  // The accepting replicas in placement order for `key`.
  std::vector<std::shared_ptr<Replica>> PlacementCandidates(
      absl::string_view key, bool keyed);
  // A fresh random key for unkeyed placement.
  std::string PlacementNonce();
  // "A SERVING; B draining; C unreachable (why)".
  std::string DescribeReplicas() const;

  const ClusterTarget target_;
  const ClusterOptions options_;

  mutable absl::Mutex mu_;
  // By dialed address.
  std::map<std::string, std::shared_ptr<Replica>> replicas_
      ABSL_GUARDED_BY(mu_);
  // Known owners, most recently used first, at most max_known_owners.
  struct KnownOwner {
    std::string session_id;
    std::string address;
  };
  std::list<KnownOwner> owner_order_ ABSL_GUARDED_BY(mu_);
  // Session id (a view of its owner_order_ entry's) -> that entry.
  std::unordered_map<std::string_view, std::list<KnownOwner>::iterator> owners_
      ABSL_GUARDED_BY(mu_);
  std::string resolve_error_ ABSL_GUARDED_BY(mu_);
  const uint64_t nonce_seed_;
  uint64_t nonce_ ABSL_GUARDED_BY(mu_) = 0;

  absl::Mutex refresh_mu_;
  bool stopping_ ABSL_GUARDED_BY(refresh_mu_) = false;
  bool refresh_requested_ ABSL_GUARDED_BY(refresh_mu_) = false;
  std::thread refresher_;
};

}  // namespace attention::client

#endif  // ATTENTION_CLIENT_CLUSTER_CLIENT_H_
