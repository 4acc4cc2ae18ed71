// Peers: the other replicas of a fleet, as --peers names them, for a
// draining replica to hand its sessions over to (server/session_handover.h).
//
// --peers is a comma-separated list of host:port; each host is an address
// or a DNS name, looked up again for every Serving() call (the headless Service
// of a StatefulSet resolves to every ready pod). Every address found is a
// candidate; this replica itself is recognised by ServerInfo.
// advertise_address and left out. A candidate is SERVING when its
// grpc.health.v1 status for attention.v1.AttentionService is SERVING and
// its ServerInfo says it is not draining.
//
// Calls to peers use the replica's own transport security and identity
// (PeerOptions::client; see ServerOptions::peer_tls_ca_file): TLS
// verifying the peer (under the name --peers gives unless the options name
// one), the replica's certificate as client certificate, and
// --peer_token_file's bearer token.
//
// Thread-safety: all methods are thread-safe.
#ifndef ATTENTION_SERVER_PEERS_H_
#define ATTENTION_SERVER_PEERS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "client/attention_client.h"
#include "server/host_port.h"

namespace attention::server {

struct PeerOptions {
  // --peers: comma-separated host:port entries (see above).
  std::string peers;
  // This replica's advertise address (left out of the peers).
  std::string self_address;
  // How peers are called: transport security and bearer token. An empty
  // tls_server_name means each entry's host.
  client::ClientOptions client;
  // Deadline of each health / ServerInfo probe.
  absl::Duration probe_timeout = absl::Seconds(1);
  // An address that did not answer a probe is not probed again for this
  // long (a dead pod's address would cost probe_timeout per session).
  absl::Duration failure_backoff = absl::Seconds(5);
};

// A SERVING peer as last probed.
struct Peer {
  std::string target;             // the resolved "ip:port" called
  std::string advertise_address;  // its SessionInfo.owner
  int64_t kv_cache_free_bytes = 0;
  std::shared_ptr<client::AttentionClient> client;
};

class Peers {
 public:
  // INVALID_ARGUMENT naming --peers for an entry that is not host:port.
  static absl::StatusOr<std::unique_ptr<Peers>> Create(PeerOptions options);

  // Resolves the entries again and probes every address found (but those
  // that failed within failure_backoff); returns the SERVING ones other
  // than this replica, most kv_cache_free_bytes first. Empty when none is
  // (or names do not resolve); failures are logged. `*unanswered` (when
  // given) says whether some address did not answer within probe_timeout
  // or by `deadline` (now, or when last probed within failure_backoff),
  // or some name was
  // not resolved by `deadline`: a peer too busy or paused to answer, a
  // dead pod's address or a slow DNS server, as opposed to a refused
  // connection or a peer that answered draining.
  //
  // Bounded: the names are looked up at once, each on a thread of its own
  // (a name still being looked up after probe_timeout, or at `deadline`,
  // is left to that thread and counts as unresolved now; a later call
  // takes its answer), and the addresses are probed at once (no probe
  // starts after `deadline`; each ends within probe_timeout and by
  // `deadline`). So it returns within two probe_timeouts, and by
  // `deadline`, however many names are slow or addresses hang.
  std::vector<Peer> Serving(absl::Time deadline, bool* unanswered = nullptr);

  const PeerOptions& options() const { return options_; }

 private:
  Peers(PeerOptions options, std::vector<HostPort> entries)
      : options_(std::move(options)),
        entries_(std::move(entries)),
        lookups_(entries_.size()) {}
  // An address to probe, and the name its TLS certificate must carry.
  struct Candidate {
    std::string target;
    std::string server_name;
  };
  struct PendingLookup;  // peers.cc
  // Looks `entry`'s name up on a thread of its own.
  static std::shared_ptr<PendingLookup> StartLookup(const HostPort& entry);
  // The entries' addresses, looked up until `deadline` (see Serving).
  std::vector<Candidate> Resolved(absl::Time deadline, bool* unanswered);
  // Probes the candidates all at once, each call ending by `deadline`:
  // each one's ServerInfo when it is SERVING, in the same order.
  std::vector<absl::StatusOr<v1::ServerInfo>> ProbeAll(
      const std::vector<Candidate>& candidates, absl::Time deadline);
  // The error of a probe of `target` that failed within failure_backoff.
  std::optional<absl::Status> RecentFailure(const std::string& target);
  // Records a probe's answers: its ServerInfo when it is SERVING. A
  // failure is remembered for failure_backoff, but a DEADLINE_EXCEEDED
  // when the probe was `cut` by the caller's deadline.
  absl::StatusOr<v1::ServerInfo> Judge(
      const std::string& target, absl::StatusOr<v1::ServerInfo> info,
      absl::StatusOr<client::ServingStatus> health, bool cut);
  // The client for `target`, created on first use.
  std::shared_ptr<client::AttentionClient> ClientFor(
      const std::string& target, const std::string& server_name);

  const PeerOptions options_;
  const std::vector<HostPort> entries_;
  absl::Mutex mu_;
  absl::flat_hash_map<std::string, std::shared_ptr<client::AttentionClient>>
      clients_ ABSL_GUARDED_BY(mu_);
  // An address whose last probe failed: when, and the probe's error.
  struct Failure {
    absl::Time when;
    absl::Status error;
  };
  absl::flat_hash_map<std::string, Failure> failed_ ABSL_GUARDED_BY(mu_);
  // Per entry, its name's look-up still running on its own thread (one at
  // a time; the next Serving() waits for it instead of starting another).
  std::vector<std::shared_ptr<PendingLookup>> lookups_ ABSL_GUARDED_BY(mu_);
};

}  // namespace attention::server

#endif  // ATTENTION_SERVER_PEERS_H_
