#include "client/cluster_client.h"

#include <algorithm>
#include <numeric>
#include <optional>
#include <random>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/functional/any_invocable.h"
#include "absl/functional/function_ref.h"
#include "absl/memory/memory.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/blocking_counter.h"
#include "client/call_outcome.h"
#include "client/placement.h"
#include "core/client_string.h"
#include "core/status_macros.h"

namespace attention::client {

namespace {

// Redirects one call follows before giving up (a session moves once per
// drain; more means replicas disagree about it).
constexpr int kMaxMoves = 4;

// Starts start(i, done) for every i < n, each an asynchronous call that
// runs its `done` once with its answer (on a gRPC thread), and returns the
// n answers in index order once all have come. No thread per call.
template <typename T>
std::vector<absl::StatusOr<T>> AllAnswers(
    size_t n,
    absl::FunctionRef<void(size_t,
                           absl::AnyInvocable<void(absl::StatusOr<T>) &&>)>
        start) {
  std::vector<absl::StatusOr<T>> answers(n, absl::UnknownError("no answer"));
  absl::BlockingCounter pending(static_cast<int>(n));
  for (size_t i = 0; i < n; ++i) {
    start(i, [&answers, &pending, i](absl::StatusOr<T> answer) {
      answers[i] = std::move(answer);
      pending.DecrementCount();
    });
  }
  pending.Wait();
  return answers;
}

// NOT_FOUND for a session that `replica` answered it does not have (with
// `status`) and no other replica has either.
absl::Status NoLongerAnywhere(absl::string_view session_id,
                              const std::string& replica,
                              const absl::Status& status) {
  return absl::NotFoundError(absl::StrCat(
      "session ", QuoteClientString(session_id), " is not on replica ", replica,
      " (", status.message(),
      ") nor on any other replica: it was deleted, it expired, or it was "
      "lost with its replica (killed, restarted without --snapshot_dir); it "
      "is not recreated"));
}

// The key of ClusterClient::owners_ (absl::string_view may be its own type).
std::string_view View(absl::string_view text) {
  return std::string_view(text.data(), text.size());
}

// `status` with `message` instead of its own: same code, same payloads.
absl::Status WithMessage(const absl::Status& status,
                         absl::string_view message) {
  absl::Status changed(status.code(), message);
  status.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
    changed.SetPayload(url, payload);
  });
  return changed;
}

// `status` with the index its message begins with (`open`, the index,
// `close`: "steps[2]", "step 2:") replaced by renumber(index); nullopt when
// the message does not begin so or renumber gives -1. Payloads are kept.
std::optional<absl::Status> Renumbered(
    const absl::Status& status, absl::string_view open, char close,
    absl::FunctionRef<int64_t(int64_t)> renumber) {
  absl::string_view message = status.message();
  if (!absl::ConsumePrefix(&message, open)) return std::nullopt;
  const size_t end = message.find(close);
  int64_t index = -1;
  if (end == absl::string_view::npos ||
      !absl::SimpleAtoi(message.substr(0, end), &index) || index < 0) {
    return std::nullopt;
  }
  const int64_t renumbered_index = renumber(index);
  if (renumbered_index < 0) return std::nullopt;
  return WithMessage(status,
                     absl::StrCat(open, renumbered_index, message.substr(end)));
}

// `status` from a replica that got steps `steps` of the caller's
// BatchDecode (in that order) as its own steps 0, 1, ...: the step its
// message begins with ("steps[j]" or "step j:", as the server names them),
// renumbered as the caller's request counts it.
absl::Status InRequestNumbering(const absl::Status& status,
                                const std::vector<int>& steps) {
  auto caller_step = [&](int64_t j) -> int64_t {
    return j < static_cast<int64_t>(steps.size()) ? steps[j] : -1;
  };
  for (const auto& [open, close] :
       {std::pair{"steps[", ']'}, std::pair{"step ", ':'}}) {
    if (std::optional<absl::Status> renumbered =
            Renumbered(status, open, close, caller_step)) {
      return *std::move(renumbered);
    }
  }
  return status;
}

// `status` that ended a lane's Decode stream at its oldest unanswered
// request, the cluster stream's request `index`, naming it as the cluster
// stream counts its writes: the lane's own number ("requests[i]: ", from
// the server or the DecodeStream) replaced, or "requests[index]: " put
// before a message that names none. Payloads are kept.
absl::Status InStreamNumbering(const absl::Status& status, int64_t index) {
  if (std::optional<absl::Status> renumbered = Renumbered(
          status, "requests[", ']', [&](int64_t) { return index; })) {
    return *std::move(renumbered);
  }
  return WithMessage(status,
                     absl::StrCat("requests[", index, "]: ", status.message()));
}

// The status of request `index` (on session `session_id`) that went to a
// lane again after its session moved, behind request `front` written after
// it, when that lane's stream ended at `front` with `status`. A server ends
// a stream at the request it names ("requests[i]: ", `ended_at_front`):
// nothing behind it was applied. Otherwise (a broken connection, a
// deadline, a cancel) this one may have been. Either way it is not
// `front`'s failure.
absl::Status BehindAFailedRequest(int64_t index, absl::string_view session_id,
                                  int64_t front, const absl::Status& status,
                                  bool ended_at_front) {
  const std::string cause = absl::StrCat(
      absl::StatusCodeToString(status.code()), ": ", status.message());
  if (ended_at_front) {
    return absl::AbortedError(
        absl::StrCat("requests[", index, "]: not applied: after session ",
                     QuoteClientString(session_id),
                     " moved it was sent again behind requests[", front,
                     "], which ended that replica's stream (", cause,
                     "); it may be sent again"));
  }
  return absl::Status(
      status.code(),
      absl::StrCat("requests[", index,
                   "]: may or may not have been applied: after session ",
                   QuoteClientString(session_id),
                   " moved it was sent again behind requests[", front,
                   "] on a stream that then failed (", cause,
                   "); read GetSession's layer_lengths for it before sending "
                   "it again"));
}

bool Unreachable(const absl::Status& status) {
  return status.code() == absl::StatusCode::kUnavailable ||
         status.code() == absl::StatusCode::kDeadlineExceeded;
}

}  // namespace

const char* ReplicaStateName(ReplicaStatus::State state) {
  switch (state) {
    case ReplicaStatus::State::kServing:
      return "SERVING";
    case ReplicaStatus::State::kDraining:
      return "draining";
    case ReplicaStatus::State::kNotServing:
      return "not-serving";
    case ReplicaStatus::State::kUnreachable:
      return "unreachable";
  }
  return "unknown";
}

// ---------------------------------------------------------------------------
// ClusterReplica

struct ClusterReplica {
  ClusterReplica(const std::string& address, const ClusterOptions& options)
      : dialed(address),
        client(AttentionClient::Connect(address, CallOptions(options))),
        probe(ProbeClient(address, options)) {
    status.address = address;
    status.dialed = address;
    status.error = "not probed yet";
  }

  static ClientOptions CallOptions(const ClusterOptions& options) {
    ClientOptions call_options = options.client;
    if (call_options.max_reconnect_backoff <= absl::ZeroDuration()) {
      call_options.max_reconnect_backoff = absl::Seconds(1);
    }
    return call_options;
  }
  // Probes and look-ups: a deadline of probe_timeout and no retries, so an
  // unreachable replica shows at once.
  static std::unique_ptr<AttentionClient> ProbeClient(
      const std::string& address, const ClusterOptions& options) {
    ClientOptions probe_options = CallOptions(options);
    probe_options.retry_max_attempts = 1;
    probe_options.call_timeout = options.probe_timeout;
    return AttentionClient::Connect(address, probe_options);
  }

  const std::string dialed;
  const std::unique_ptr<AttentionClient> client;  // the calls
  const std::unique_ptr<AttentionClient> probe;
  // Guarded by the ClusterClient's mu_ (mutable: probes and failures update
  // it through const references).
  mutable ReplicaStatus status;
  // When probes or calls started failing to reach it (none since a probe
  // last reached it), if they do.
  mutable std::optional<absl::Time> unreachable_since;
};

// ---------------------------------------------------------------------------
// ClusterClient: membership

ClusterClient::ClusterClient(ClusterTarget target, ClusterOptions options)
    : target_(std::move(target)),
      options_(std::move(options)),
      nonce_seed_(std::random_device()()) {}

absl::StatusOr<std::unique_ptr<ClusterClient>> ClusterClient::Open(
    const std::string& target, ClusterOptions options) {
  ATTN_ASSIGN_OR_RETURN(ClusterTarget parsed, ParseClusterTarget(target));
  if (options.move_wait < absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ClusterOptions move_wait (", absl::FormatDuration(options.move_wait),
        ") must not be negative"));
  }
  if (!(options.refresh_interval > absl::ZeroDuration()) ||
      !(options.probe_timeout > absl::ZeroDuration())) {
    // Zero would probe every replica without a pause, or fail every probe.
    return absl::InvalidArgumentError(absl::StrCat(
        "ClusterOptions refresh_interval (",
        absl::FormatDuration(options.refresh_interval), ") and probe_timeout (",
        absl::FormatDuration(options.probe_timeout), ") must be positive"));
  }
  // Unreadable TLS files fail here rather than on every call.
  ATTN_RETURN_IF_ERROR(OpenChannel("localhost", options.client).status());
  auto cluster = absl::WrapUnique(
      new ClusterClient(std::move(parsed), std::move(options)));
  cluster->Refresh();
  cluster->refresher_ =
      std::thread([raw = cluster.get()] { raw->RefreshLoop(); });
  return cluster;
}

ClusterClient::~ClusterClient() {
  {
    absl::MutexLock lock(&refresh_mu_);
    stopping_ = true;
  }
  if (refresher_.joinable()) refresher_.join();
}

bool ClusterClient::RefreshDue() const {
  return stopping_ || refresh_requested_;
}

void ClusterClient::RequestRefresh() {
  absl::MutexLock lock(&refresh_mu_);
  refresh_requested_ = true;
}

void ClusterClient::RefreshLoop() {
  refresh_mu_.Lock();
  while (!stopping_) {
    refresh_mu_.AwaitWithTimeout(
        absl::Condition(this, &ClusterClient::RefreshDue),
        options_.refresh_interval);
    if (stopping_) break;
    refresh_requested_ = false;
    refresh_mu_.Unlock();
    Refresh();
    refresh_mu_.Lock();
  }
  refresh_mu_.Unlock();
}

void ClusterClient::Refresh() {
  absl::StatusOr<std::vector<std::string>> addresses =
      options_.resolver ? options_.resolver() : ResolveClusterTarget(target_);
  std::vector<std::shared_ptr<Replica>> replicas;
  {
    absl::MutexLock lock(&mu_);
    if (addresses.ok()) {
      resolve_error_.clear();
      const std::set<std::string> listed(addresses->begin(), addresses->end());
      for (const std::string& address : listed) {
        if (!replicas_.contains(address)) {
          replicas_[address] = std::make_shared<Replica>(address, options_);
        }
      }
      for (auto& [dialed, replica] : replicas_) {
        replica->status.listed = listed.contains(dialed);
      }
    } else {
      // Keep the last membership; say why it is stale.
      resolve_error_ = std::string(addresses.status().message());
    }
    for (auto& [dialed, replica] : replicas_) replicas.push_back(replica);
  }
  // Every replica probed at once, on gRPC's callback API.
  absl::BlockingCounter pending(static_cast<int>(replicas.size()));
  for (const std::shared_ptr<Replica>& replica : replicas) {
    Probe(*replica, [&pending] { pending.DecrementCount(); });
  }
  pending.Wait();
  ForgetUnreachable();
}

absl::Time ClusterClient::Now() const {
  return options_.now ? options_.now() : absl::Now();
}

void ClusterClient::ForgetUnreachable() {
  const absl::Time now = Now();
  absl::MutexLock lock(&mu_);
  // Calls, streams and look-ups holding a forgotten replica keep it (and
  // its channels) until they are done with it.
  std::erase_if(replicas_, [&](const auto& entry) {
    const Replica& replica = *entry.second;
    return !replica.status.listed && replica.unreachable_since.has_value() &&
           now - *replica.unreachable_since > options_.forget_unreachable_after;
  });
}

void ClusterClient::Probe(Replica& replica,
                          absl::AnyInvocable<void() &&> done) {
  replica.probe->CheckHealthAsync(
      "", [this, &replica, done = std::move(done)](
              absl::StatusOr<ServingStatus> health) mutable {
        if (!health.ok()) {
          RecordProbe(replica, health, health.status());
          std::move(done)();
          return;
        }
        replica.probe->GetServerInfoAsync(
            [this, &replica, health, done = std::move(done)](
                absl::StatusOr<v1::ServerInfo> info) mutable {
              RecordProbe(replica, health, info);
              std::move(done)();
            });
      });
}

void ClusterClient::RecordProbe(Replica& replica,
                                const absl::StatusOr<ServingStatus>& health,
                                const absl::StatusOr<v1::ServerInfo>& info) {
  using State = ReplicaStatus::State;
  const absl::Time now = Now();
  absl::MutexLock lock(&mu_);
  ReplicaStatus& status = replica.status;
  const bool unreachable = !info.ok() && Unreachable(info.status());
  if (!unreachable) {
    replica.unreachable_since.reset();
  } else if (!replica.unreachable_since.has_value()) {
    replica.unreachable_since = now;
  }
  if (!info.ok()) {
    status.state = unreachable ? State::kUnreachable : State::kNotServing;
    status.error = std::string(info.status().message());
    return;
  }
  status.info = *info;
  if (!info->advertise_address().empty()) {
    status.address = info->advertise_address();
  }
  status.error.clear();
  if (info->draining()) {
    status.state = State::kDraining;
  } else if (*health == ServingStatus::kServing) {
    status.state = State::kServing;
  } else {
    status.state = State::kNotServing;
    status.error = "health check: not serving";
  }
}

std::shared_ptr<ClusterReplica> ClusterClient::FindLocked(
    const std::string& address) const {
  auto it = replicas_.find(address);
  if (it != replicas_.end()) return it->second;
  // A pod back under a new address (a restart) leaves its old address's
  // entry, unreachable, under the same name until it is forgotten: the
  // reachable entry of the name first.
  std::shared_ptr<ClusterReplica> unreachable;
  for (const auto& [dialed, replica] : replicas_) {
    if (replica->status.address != address) continue;
    if (!replica->unreachable_since.has_value()) return replica;
    if (unreachable == nullptr) unreachable = replica;
  }
  return unreachable;
}

std::shared_ptr<ClusterReplica> ClusterClient::ReplicaAt(
    const std::string& address) {
  std::shared_ptr<Replica> replica;
  {
    absl::MutexLock lock(&mu_);
    replica = FindLocked(address);
    if (replica != nullptr) return replica;
    // An owner outside the membership (e.g. named by a redirect before the
    // next resolution lists it): dial it as named.
    replica = std::make_shared<Replica>(address, options_);
    replicas_[address] = replica;
  }
  RequestRefresh();
  return replica;
}

std::string ClusterClient::AddressOf(const Replica& replica) const {
  absl::MutexLock lock(&mu_);
  return replica.status.address;
}

std::vector<std::shared_ptr<ClusterReplica>> ClusterClient::AllReplicas()
    const {
  absl::MutexLock lock(&mu_);
  std::vector<std::shared_ptr<Replica>> replicas;
  for (const auto& [dialed, replica] : replicas_) replicas.push_back(replica);
  return replicas;
}

bool ClusterClient::Draining(const Replica& replica) const {
  absl::MutexLock lock(&mu_);
  return replica.status.state == ReplicaStatus::State::kDraining;
}

void ClusterClient::MarkDraining(const Replica& replica) {
  {
    absl::MutexLock lock(&mu_);
    replica.status.state = ReplicaStatus::State::kDraining;
  }
  RequestRefresh();
}

void ClusterClient::MarkUnreachable(const Replica& replica,
                                    const absl::Status& why) {
  const absl::Time now = Now();
  {
    absl::MutexLock lock(&mu_);
    ReplicaStatus& status = replica.status;
    status.state = ReplicaStatus::State::kUnreachable;
    status.error = std::string(why.message());
    // As a failed probe: look-ups prefer a reachable entry of its name, and
    // the time to forget it runs from here.
    if (!replica.unreachable_since.has_value()) {
      replica.unreachable_since = now;
    }
  }
  RequestRefresh();
}

std::vector<ReplicaStatus> ClusterClient::Replicas() const {
  std::vector<ReplicaStatus> statuses;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [dialed, replica] : replicas_) {
      statuses.push_back(replica->status);
    }
  }
  std::sort(statuses.begin(), statuses.end(),
            [](const ReplicaStatus& a, const ReplicaStatus& b) {
              return std::make_tuple(!a.listed, a.address, a.dialed) <
                     std::make_tuple(!b.listed, b.address, b.dialed);
            });
  return statuses;
}

std::string ClusterClient::DescribeReplicas() const {
  std::vector<std::string> parts;
  for (const ReplicaStatus& replica : Replicas()) {
    if (!replica.listed) continue;
    std::string part =
        absl::StrCat(replica.address, " ", ReplicaStateName(replica.state));
    if (!replica.error.empty())
      absl::StrAppend(&part, " (", replica.error, ")");
    parts.push_back(std::move(part));
  }
  absl::MutexLock lock(&mu_);
  if (!resolve_error_.empty()) parts.push_back(resolve_error_);
  if (parts.empty()) return "the cluster target lists no replica";
  return absl::StrJoin(parts, "; ");
}

// ---------------------------------------------------------------------------
// ClusterClient: owners

void ClusterClient::SetOwner(absl::string_view session_id,
                             const std::string& address) {
  if (address.empty()) return;
  absl::MutexLock lock(&mu_);
  auto it = owners_.find(View(session_id));
  if (it != owners_.end()) {
    it->second->address = address;
    owner_order_.splice(owner_order_.begin(), owner_order_, it->second);
  } else {
    owner_order_.push_front(KnownOwner{std::string(session_id), address});
    owners_.emplace(owner_order_.front().session_id, owner_order_.begin());
  }
  while (owner_order_.size() > options_.max_known_owners) {
    // A forgotten session is looked up again at its next use.
    owners_.erase(owner_order_.back().session_id);
    owner_order_.pop_back();
  }
}

void ClusterClient::Learn(const v1::SessionInfo& info, const Replica& replica) {
  SetOwner(info.session_id(),
           info.owner().empty() ? AddressOf(replica) : info.owner());
}

void ClusterClient::Forget(absl::string_view session_id) {
  absl::MutexLock lock(&mu_);
  ForgetOwnerLocked(session_id);
}

void ClusterClient::ForgetOwnerLocked(absl::string_view session_id) {
  auto it = owners_.find(View(session_id));
  if (it == owners_.end()) return;
  const std::list<KnownOwner>::iterator entry = it->second;
  owners_.erase(it);  // before the entry its key views
  owner_order_.erase(entry);
}

std::string ClusterClient::OwnerOf(absl::string_view session_id) const {
  absl::MutexLock lock(&mu_);
  auto it = owners_.find(View(session_id));
  return it == owners_.end() ? std::string() : it->second->address;
}

std::string ClusterClient::UseOwner(absl::string_view session_id) {
  absl::MutexLock lock(&mu_);
  auto it = owners_.find(View(session_id));
  if (it == owners_.end()) return std::string();
  owner_order_.splice(owner_order_.begin(), owner_order_, it->second);
  return it->second->address;
}

ClusterClient::Location ClusterClient::Locate(absl::string_view session_id,
                                              const Replica* skip) {
  std::vector<std::shared_ptr<Replica>> replicas = AllReplicas();
  std::erase_if(replicas, [&](const std::shared_ptr<Replica>& replica) {
    return replica.get() == skip;
  });
  // Every replica at once: one that does not answer costs one probe
  // deadline, however many do not.
  const std::vector<absl::StatusOr<v1::SessionInfo>> answers =
      AllAnswers<v1::SessionInfo>(replicas.size(), [&](size_t i, auto done) {
        replicas[i]->probe->GetSessionAsync(session_id, std::move(done));
      });
  // By dialed address, whichever answered first: the same answers always
  // give the same owner.
  Location location;
  for (size_t i = 0; i < replicas.size(); ++i) {
    const absl::StatusOr<v1::SessionInfo>& info = answers[i];
    if (info.ok()) {
      location.replica =
          info->owner().empty() ? replicas[i] : ReplicaAt(info->owner());
      return location;
    }
    if (std::optional<std::string> owner = MovedSessionOwner(info.status())) {
      location.replica = ReplicaAt(*owner);
      return location;
    }
    if (info.status().code() != absl::StatusCode::kNotFound) {
      absl::StrAppend(&location.unanswered,
                      location.unanswered.empty() ? "" : ", ",
                      AddressOf(*replicas[i]));
    }
  }
  return location;
}

absl::Status ClusterClient::NotOnAnyReplica(absl::string_view session_id,
                                            const Location& location,
                                            absl::Status not_found) {
  if (location.unanswered.empty()) return not_found;
  return absl::UnavailableError(absl::StrCat(
      not_found.message(), "; but replicas ", location.unanswered,
      " did not answer and session ", QuoteClientString(session_id),
      " may be on one of them: retry once they serve"));
}

absl::StatusOr<std::shared_ptr<ClusterReplica>> ClusterClient::Confirm(
    absl::string_view session_id, const std::shared_ptr<Replica>& replica) {
  // The probe first: no retries, so a replica that is gone answers at once
  // (the retrying client spent seconds per session on one). On a draining
  // replica the answer waits while the session is sealed for its move,
  // which may outlast the probe's deadline: then the full call timeout.
  absl::StatusOr<v1::SessionInfo> info = replica->probe->GetSession(session_id);
  if (info.status().code() == absl::StatusCode::kDeadlineExceeded) {
    info = replica->client->GetSession(session_id);
  }
  if (info.ok()) return replica;
  if (std::optional<std::string> owner = MovedSessionOwner(info.status())) {
    SetOwner(session_id, *owner);
    return ReplicaAt(*owner);
  }
  const Location location = Locate(session_id, replica.get());
  if (location.replica != nullptr) {
    SetOwner(session_id, AddressOf(*location.replica));
    return location.replica;
  }
  if (info.status().code() != absl::StatusCode::kNotFound) {
    // The replica may still hold it (unreachable, or drained to its
    // --snapshot_dir): the record stays.
    return absl::Status(
        info.status().code(),
        absl::StrCat("replica ", AddressOf(*replica), ", which holds session ",
                     QuoteClientString(session_id), ", did not answer (",
                     info.status().message(),
                     ") and no other replica that answered has the session"));
  }
  Forget(session_id);
  return NotOnAnyReplica(
      session_id, location,
      absl::NotFoundError(absl::StrCat(
          "session ", QuoteClientString(session_id), " is not on its replica ",
          AddressOf(*replica), " (", info.status().message(),
          ") nor on any other replica that answered; it is not recreated")));
}

absl::StatusOr<std::shared_ptr<ClusterReplica>> ClusterClient::OwnerReplica(
    absl::string_view session_id) {
  const std::string owner = UseOwner(session_id);
  if (!owner.empty()) {
    std::shared_ptr<Replica> replica = ReplicaAt(owner);
    if (!Draining(*replica)) return replica;
    return Confirm(session_id, replica);
  }
  const Location location = Locate(session_id, nullptr);
  if (location.replica != nullptr) {
    SetOwner(session_id, AddressOf(*location.replica));
    return location.replica;
  }
  return NotOnAnyReplica(
      session_id, location,
      absl::NotFoundError(
          absl::StrCat("session ", QuoteClientString(session_id),
                       " is on none of the cluster's replicas that answered (",
                       DescribeReplicas(), ")")));
}

absl::StatusOr<v1::SessionInfo> ClusterClient::AwaitMove(
    absl::string_view session_id, const Replica& replica) {
  const absl::Time deadline = absl::Now() + options_.move_wait;
  absl::Duration pause = absl::Milliseconds(20);
  absl::StatusOr<v1::SessionInfo> here;
  do {
    absl::SleepFor(std::min(pause, deadline - absl::Now()));
    pause = std::min(2 * pause, absl::Milliseconds(500));
    here = replica.probe->GetSession(session_id);
  } while (here.ok() && absl::Now() < deadline);
  return here;
}

absl::StatusOr<std::shared_ptr<ClusterReplica>> ClusterClient::Recover(
    absl::string_view session_id, absl::string_view method,
    const Replica& replica, const absl::Status& status, Resend resend) {
  const std::string from = AddressOf(replica);
  if (std::optional<std::string> owner = MovedSessionOwner(status)) {
    // Moved by a draining replica; the call changed nothing.
    MarkDraining(replica);
    SetOwner(session_id, *owner);
    return ReplicaAt(*owner);
  }
  if (IsSessionMoving(status)) {
    // Being moved right now; the call changed nothing. The replica answers
    // GetSession once the move is over: the redirect, or (the move failed)
    // the session, still there.
    MarkDraining(replica);
    return Confirm(session_id, ReplicaAt(from));
  }
  if (status.code() == absl::StatusCode::kNotFound) {
    // Changed nothing either. It may live elsewhere: moved by a replica
    // whose address now belongs to a new pod that never had it.
    const Location location = Locate(session_id, &replica);
    if (location.replica != nullptr) {
      SetOwner(session_id, AddressOf(*location.replica));
      return location.replica;
    }
    Forget(session_id);
    return NotOnAnyReplica(session_id, location,
                           NoLongerAnywhere(session_id, from, status));
  }
  if (status.code() != absl::StatusCode::kUnavailable) return status;
  absl::StatusOr<v1::SessionInfo> here = replica.probe->GetSession(session_id);
  if (here.ok() && RefusedWhileDraining(status)) {
    // A fork refused by a drain that has not moved the session yet: it
    // goes where the drain moves it.
    MarkDraining(replica);
    here = AwaitMove(session_id, replica);
  }
  // The replica's own UNAVAILABLE (overloaded) while it holds the session:
  // the server's answer stands.
  if (here.ok()) return status;
  std::shared_ptr<Replica> found;
  Location location;
  if (std::optional<std::string> owner = MovedSessionOwner(here.status())) {
    found = ReplicaAt(*owner);
  } else {
    if (Unreachable(here.status())) MarkUnreachable(replica, here.status());
    location = Locate(session_id, &replica);
    found = location.replica;
  }
  if (found == nullptr && here.status().code() == absl::StatusCode::kNotFound) {
    // Reachable again (restarted) without the session.
    Forget(session_id);
    return NotOnAnyReplica(session_id, location,
                           NoLongerAnywhere(session_id, from, here.status()));
  }
  if (found == nullptr) {
    return absl::UnavailableError(absl::StrCat(
        "replica ", from, ", which holds session ",
        QuoteClientString(session_id), ", is unreachable (", status.message(),
        ") and no other replica has the session; it comes back only if that "
        "replica restarts with its --snapshot_dir"));
  }
  SetOwner(session_id, AddressOf(*found));
  // A call the replica never saw, or refused itself (overloaded, draining),
  // may go to the session's new place.
  if (resend == Resend::kIfFoundElsewhere || NeverSent(status) ||
      RefusedByServer(status)) {
    return found;
  }
  return absl::UnavailableError(absl::StrCat(
      method, " on session ", QuoteClientString(session_id), ": replica ", from,
      " became unreachable (", status.message(), "); the session is now on ",
      AddressOf(*found),
      ". The call may or may not have been applied: read GetSession's "
      "layer_lengths and resend what is missing"));
}

template <typename T>
absl::StatusOr<T> ClusterClient::OnSession(
    absl::string_view session_id, absl::string_view method, Resend resend,
    const std::function<absl::StatusOr<T>(AttentionClient&)>& call) {
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<Replica> replica,
                        OwnerReplica(session_id));
  for (int moves = 0;; ++moves) {
    absl::StatusOr<T> result = call(*replica->client);
    if (result.ok() || moves == kMaxMoves) return result;
    ATTN_ASSIGN_OR_RETURN(replica, Recover(session_id, method, *replica,
                                           result.status(), resend));
  }
}

// ---------------------------------------------------------------------------
// ClusterClient: calls

std::string ClusterClient::PlacementNonce() {
  absl::MutexLock lock(&mu_);
  return absl::StrCat(nonce_seed_, "/", nonce_++);
}

std::vector<std::shared_ptr<ClusterReplica>> ClusterClient::PlacementCandidates(
    absl::string_view key, bool keyed) {
  std::vector<ReplicaLoad> loads;
  std::map<std::string, std::shared_ptr<Replica>> by_address;
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [dialed, replica] : replicas_) {
      const ReplicaStatus& status = replica->status;
      if (!status.listed || by_address.contains(status.address)) continue;
      by_address[status.address] = replica;
      ReplicaLoad& load = loads.emplace_back();
      load.address = status.address;
      load.accepting = status.state == ReplicaStatus::State::kServing;
      // kv_cache_free_bytes is capacity - used; servers before fleets
      // leave it 0. Each figure is taken inside [0, capacity], so that none
      // a replica sends can overflow this arithmetic.
      const int64_t capacity =
          std::max<int64_t>(0, status.info.kv_cache_capacity_bytes());
      load.kv_capacity_bytes = capacity;
      load.kv_free_bytes = std::max(
          std::clamp<int64_t>(status.info.kv_cache_free_bytes(), 0, capacity),
          capacity - std::clamp<int64_t>(status.info.kv_cache_used_bytes(), 0,
                                         capacity));
    }
  }
  std::vector<std::shared_ptr<Replica>> candidates;
  for (const std::string& address :
       PlacementOrder(loads, key, keyed, options_.placement_tie_fraction)) {
    candidates.push_back(by_address[address]);
  }
  return candidates;
}

absl::StatusOr<v1::SessionInfo> ClusterClient::CreateSession(
    const v1::SessionSpec& spec, absl::Duration idle_timeout,
    absl::string_view placement_key) {
  const bool keyed = !placement_key.empty();
  const std::string key = keyed ? std::string(placement_key) : PlacementNonce();
  std::vector<std::shared_ptr<Replica>> candidates =
      PlacementCandidates(key, keyed);
  if (candidates.empty()) {
    Refresh();
    candidates = PlacementCandidates(key, keyed);
  }
  if (candidates.empty()) {
    return absl::UnavailableError(
        absl::StrCat("no replica of the cluster accepts new sessions: ",
                     DescribeReplicas()));
  }
  std::vector<std::string> refusals;
  absl::StatusCode code = absl::StatusCode::kUnavailable;
  for (const std::shared_ptr<Replica>& replica : candidates) {
    absl::StatusOr<v1::SessionInfo> info =
        replica->client->CreateSession(spec, idle_timeout);
    if (info.ok()) {
      Learn(*info, *replica);
      return info;
    }
    // A refusal changes nothing: the next replica may take it. Any other
    // failure may have come after the replica created the session (the
    // reply cut or over the receive limit): it ends the call, so that no
    // second replica creates one more.
    code = info.status().code();
    if (CreationInDoubt(info.status())) {
      return absl::Status(
          code, absl::StrCat(AddressOf(*replica), ": ", info.status().message(),
                             " (the replica may have created the session: "
                             "unused, it expires after its idle timeout)"));
    }
    // What is left of UNAVAILABLE and RESOURCE_EXHAUSTED is a refusal
    // another replica may not give (draining, overloaded, out of KV memory
    // or a quota, unreachable); other codes any replica would give.
    if (code != absl::StatusCode::kUnavailable &&
        code != absl::StatusCode::kResourceExhausted) {
      return info.status();
    }
    if (code == absl::StatusCode::kUnavailable) RequestRefresh();
    refusals.push_back(
        absl::StrCat(AddressOf(*replica), ": ", info.status().message()));
  }
  return absl::Status(code, absl::StrCat("no replica accepted the session (",
                                         absl::StrJoin(refusals, "; "), ")"));
}

absl::StatusOr<v1::SessionInfo> ClusterClient::GetSession(
    absl::string_view session_id) {
  return OnSession<v1::SessionInfo>(
      session_id, "GetSession", Resend::kIfFoundElsewhere,
      [&](AttentionClient& client) { return client.GetSession(session_id); });
}

absl::StatusOr<std::vector<v1::SessionInfo>> ClusterClient::ListSessions() {
  std::vector<v1::SessionInfo> sessions;
  std::vector<std::string> unanswered;
  std::set<std::string> asked;
  for (const ReplicaStatus& status : Replicas()) {
    if (!status.listed || !asked.insert(status.address).second) continue;
    // One known unreachable may still hold sessions (a partition).
    if (status.state == ReplicaStatus::State::kUnreachable) {
      unanswered.push_back(
          absl::StrCat(status.address, " (unreachable: ", status.error, ")"));
      continue;
    }
    std::shared_ptr<Replica> replica = ReplicaAt(status.dialed);
    absl::StatusOr<std::vector<v1::SessionInfo>> listed =
        replica->client->ListSessions();
    if (!listed.ok()) {
      unanswered.push_back(
          absl::StrCat(status.address, " (", listed.status().message(), ")"));
      continue;
    }
    for (v1::SessionInfo& info : *listed) {
      Learn(info, *replica);
      sessions.push_back(std::move(info));
    }
  }
  if (!unanswered.empty()) {
    return absl::UnavailableError(
        absl::StrCat("ListSessions: replicas did not answer: ",
                     absl::StrJoin(unanswered, ", ")));
  }
  return sessions;
}

absl::Status ClusterClient::DeleteSession(absl::string_view session_id) {
  absl::StatusOr<bool> deleted =
      OnSession<bool>(session_id, "DeleteSession", Resend::kIfFoundElsewhere,
                      [&](AttentionClient& client) -> absl::StatusOr<bool> {
                        ATTN_RETURN_IF_ERROR(client.DeleteSession(session_id));
                        return true;
                      });
  if (deleted.ok()) Forget(session_id);
  return deleted.status();
}

absl::StatusOr<v1::SessionInfo> ClusterClient::ForkSession(
    absl::string_view session_id) {
  // Not re-sent after UNAVAILABLE: a fork whose reply was lost exists.
  absl::StatusOr<v1::SessionInfo> fork = OnSession<v1::SessionInfo>(
      session_id, "ForkSession", Resend::kNever,
      [&](AttentionClient& client) { return client.ForkSession(session_id); });
  if (fork.ok()) {
    // The fork lives with its parent.
    SetOwner(fork->session_id(),
             fork->owner().empty() ? OwnerOf(session_id) : fork->owner());
  }
  return fork;
}

absl::StatusOr<v1::SessionInfo> ClusterClient::TruncateSession(
    absl::string_view session_id, int64_t length) {
  return OnSession<v1::SessionInfo>(
      session_id, "TruncateSession", Resend::kIfFoundElsewhere,
      [&](AttentionClient& client) {
        return client.TruncateSession(session_id, length);
      });
}

absl::StatusOr<v1::AttentionResult> ClusterClient::Prefill(
    const v1::PrefillRequest& request) {
  return OnSession<v1::AttentionResult>(
      request.session_id(), "Prefill", Resend::kNever,
      [&](AttentionClient& client) { return client.Prefill(request); });
}

absl::StatusOr<v1::AttentionResult> ClusterClient::DecodeStep(
    const v1::DecodeRequest& request) {
  return OnSession<v1::AttentionResult>(
      request.session_id(), "DecodeStep", Resend::kNever,
      [&](AttentionClient& client) { return client.DecodeStep(request); });
}

absl::StatusOr<std::vector<v1::AttentionResult>> ClusterClient::BatchDecode(
    const v1::BatchDecodeRequest& request) {
  std::vector<v1::AttentionResult> results(request.steps_size());
  std::vector<int> steps(request.steps_size());
  std::iota(steps.begin(), steps.end(), 0);
  ATTN_RETURN_IF_ERROR(BatchOn(request, steps, 0, &results));
  return results;
}

absl::Status ClusterClient::BatchOn(const v1::BatchDecodeRequest& request,
                                    const std::vector<int>& steps, int moves,
                                    std::vector<v1::AttentionResult>* results) {
  // One part per owner, in order of first step. Routing fails before
  // anything is sent.
  struct Part {
    std::shared_ptr<Replica> replica;
    std::vector<int> steps;
    absl::Status status;
  };
  std::vector<Part> parts;
  for (int step : steps) {
    ATTN_ASSIGN_OR_RETURN(std::shared_ptr<Replica> replica,
                          OwnerReplica(request.steps(step).session_id()));
    auto part = std::find_if(parts.begin(), parts.end(), [&](const Part& p) {
      return p.replica == replica;
    });
    if (part == parts.end()) {
      part = parts.insert(parts.end(), Part{replica, {}, absl::OkStatus()});
    }
    part->steps.push_back(step);
  }
  auto sub_request = [&](const Part& part) {
    v1::BatchDecodeRequest sub;
    for (int step : part.steps) *sub.add_steps() = request.steps(step);
    return sub;
  };
  // What a part's answer leaves: its results in place, or its status after
  // the recovery it calls for.
  auto settle = [&](Part& part,
                    absl::StatusOr<std::vector<v1::AttentionResult>> got) {
    if (got.ok() && got->size() != part.steps.size()) {
      // A replica breaking the one-result-per-step contract (another
      // version?): refuse its answer rather than index past it.
      part.status = absl::InternalError(absl::StrCat(
          AddressOf(*part.replica), " answered a BatchDecode of ",
          part.steps.size(), " steps with ", got->size(), " results"));
      return;
    }
    if (got.ok()) {
      for (size_t i = 0; i < part.steps.size(); ++i) {
        (*results)[part.steps[i]] = std::move((*got)[i]);
      }
      return;
    }
    const absl::Status& status = got.status();
    if (IsSessionMoving(status)) MarkDraining(*part.replica);
    if ((status.code() == absl::StatusCode::kNotFound || NeverSent(status) ||
         IsSessionMoving(status)) &&
        moves < kMaxMoves) {
      // A session of the part moved, is being moved or is gone, or the
      // replica never saw the part: it changed nothing. Find each session's
      // owner again (after the move) and send the part again.
      std::set<std::string> sessions;
      for (int step : part.steps) {
        sessions.insert(request.steps(step).session_id());
      }
      for (const std::string& session : sessions) {
        absl::StatusOr<std::shared_ptr<Replica>> owner =
            Confirm(session, part.replica);
        if (!owner.ok()) {
          part.status = owner.status();
          return;
        }
      }
      part.status = BatchOn(request, part.steps, moves + 1, results);
      return;
    }
    part.status = InRequestNumbering(status, part.steps);
    if (status.code() == absl::StatusCode::kUnavailable) {
      absl::StatusOr<std::shared_ptr<Replica>> next =
          Recover(request.steps(part.steps.front()).session_id(), "BatchDecode",
                  *part.replica, status, Resend::kNever);
      if (!next.ok()) part.status = next.status();
    }
  };
  if (parts.size() == 1) {
    Part& part = parts.front();
    settle(part, part.replica->client->BatchDecode(sub_request(part)));
  } else {
    // Every part in flight at once; then the answers, and any recovery, in
    // part order.
    std::vector<absl::StatusOr<std::vector<v1::AttentionResult>>> answers =
        AllAnswers<std::vector<v1::AttentionResult>>(
            parts.size(), [&](size_t p, auto done) {
              parts[p].replica->client->BatchDecodeAsync(sub_request(parts[p]),
                                                         std::move(done));
            });
    for (size_t p = 0; p < parts.size(); ++p) {
      settle(parts[p], std::move(answers[p]));
    }
  }
  std::vector<std::string> applied;
  const Part* failed = nullptr;
  for (const Part& part : parts) {
    if (part.status.ok()) {
      applied.push_back(AddressOf(*part.replica));
    } else if (failed == nullptr) {
      failed = &part;
    }
  }
  if (failed == nullptr) return absl::OkStatus();
  if (applied.empty()) return failed->status;
  return absl::Status(
      failed->status.code(),
      absl::StrCat("BatchDecode split over ", parts.size(),
                   " replicas (all or nothing per replica): the steps on ",
                   absl::StrJoin(applied, ", "), " were applied; those on ",
                   AddressOf(*failed->replica),
                   " failed: ", failed->status.message()));
}

absl::StatusOr<v1::AttentionResult> ClusterClient::Attention(
    const v1::AttentionRequest& request) {
  std::vector<std::shared_ptr<Replica>> candidates =
      PlacementCandidates(PlacementNonce(), /*keyed=*/false);
  absl::Status last = absl::UnavailableError(absl::StrCat(
      "no replica of the cluster is SERVING: ", DescribeReplicas()));
  for (const std::shared_ptr<Replica>& replica : candidates) {
    absl::StatusOr<v1::AttentionResult> result =
        replica->client->Attention(request);
    // Stateless: another replica computes the same.
    if (result.ok() ||
        result.status().code() != absl::StatusCode::kUnavailable) {
      return result;
    }
    RequestRefresh();
    last = result.status();
  }
  return last;
}

absl::Status ClusterClient::ExportSession(
    absl::string_view session_id,
    const std::function<absl::Status(const v1::SessionChunk&)>& sink) {
  ATTN_ASSIGN_OR_RETURN(std::shared_ptr<Replica> replica,
                        OwnerReplica(session_id));
  for (int moves = 0;; ++moves) {
    bool delivered = false;
    absl::Status status = replica->client->ExportSession(
        session_id, [&](const v1::SessionChunk& record) {
          delivered = true;
          return sink(record);
        });
    // Once the sink has records, starting again would repeat them.
    if (status.ok() || delivered || moves == kMaxMoves) return status;
    ATTN_ASSIGN_OR_RETURN(replica,
                          Recover(session_id, "ExportSession", *replica, status,
                                  Resend::kIfFoundElsewhere));
  }
}

std::unique_ptr<ClusterDecodeStream> ClusterClient::OpenDecodeStream() {
  return absl::WrapUnique(new ClusterDecodeStream(this));
}

// ---------------------------------------------------------------------------
// ClusterDecodeStream

struct ClusterDecodeStream::Entry {
  int64_t index = 0;  // in write order
  v1::DecodeRequest request;
  std::optional<absl::StatusOr<v1::AttentionResult>> result;
  Lane* lane = nullptr;  // where it waits for its result
  int moves = 0;
};

struct ClusterDecodeStream::Lane {
  std::shared_ptr<ClusterReplica> replica;
  std::unique_ptr<DecodeStream> stream;
  std::deque<Entry*> unanswered;  // in the order written to `stream`
};

ClusterDecodeStream::ClusterDecodeStream(ClusterClient* cluster)
    : cluster_(cluster) {}

ClusterDecodeStream::~ClusterDecodeStream() = default;

ClusterDecodeStream::Lane* ClusterDecodeStream::LaneFor(
    const std::shared_ptr<ClusterReplica>& replica) {
  std::unique_ptr<Lane>& lane = lanes_[replica.get()];
  if (lane == nullptr) {
    // The replica's half-closed streams have had a request's time to end:
    // those that have not are cancelled (they wait for nothing), so that
    // at most one per replica is kept.
    std::erase_if(closing_, [&](const std::unique_ptr<Lane>& closed) {
      return closed->replica == replica;
    });
    lane = std::make_unique<Lane>();
    lane->replica = replica;
    lane->stream = replica->client->OpenDecodeStream();
  }
  return lane.get();
}

void ClusterDecodeStream::Fail(Entry* entry, absl::Status status) {
  entry->lane = nullptr;
  entry->result = std::move(status);
  first_failed_ = std::min(first_failed_, entry->index);
}

void ClusterDecodeStream::CloseIdleLanes() {
  for (auto it = lanes_.begin(); it != lanes_.end();) {
    Lane& lane = *it->second;
    if (!lane.unanswered.empty() || !cluster_->Draining(*lane.replica)) {
      ++it;
      continue;
    }
    lane.stream->WritesDone();
    closing_.push_back(std::move(it->second));
    it = lanes_.erase(it);
  }
}

ClusterDecodeStream::Lane* ClusterDecodeStream::LaneWaitingOn(
    const std::string& session_id) const {
  for (const auto& [replica, lane] : lanes_) {
    for (const Entry* entry : lane->unanswered) {
      if (entry->request.session_id() == session_id) return lane.get();
    }
  }
  return nullptr;
}

void ClusterDecodeStream::Dispatch(Entry* entry) {
  // Behind an earlier request of the session that still waits (at its
  // former owner, say): re-sent together, in order, if that one moves.
  Lane* lane = LaneWaitingOn(entry->request.session_id());
  if (lane == nullptr) {
    absl::StatusOr<std::shared_ptr<ClusterReplica>> owner =
        cluster_->OwnerReplica(entry->request.session_id());
    if (!owner.ok()) {
      Fail(entry, owner.status());
      return;
    }
    lane = LaneFor(*owner);
  }
  entry->lane = lane;
  lane->unanswered.push_back(entry);
  // A refused write means the lane's stream has ended: Pump says why.
  if (lane->stream->Write(entry->request) || lane->unanswered.size() > 1) {
    return;
  }
  // It ended with nothing of ours in it (its replica drained or restarted
  // since our last request there): this one was not sent. A new stream.
  const std::shared_ptr<ClusterReplica> replica = lane->replica;
  lanes_.erase(replica.get());
  lane = LaneFor(replica);
  entry->lane = lane;
  lane->unanswered.push_back(entry);
  lane->stream->Write(entry->request);
}

void ClusterDecodeStream::DispatchAll(const std::deque<Entry*>& entries) {
  for (Entry* entry : entries) {
    if (entry->index < first_failed_) {
      Dispatch(entry);
      continue;
    }
    // An earlier one failed: nothing after it goes (the stream ends at
    // that one, as on one server).
    Fail(entry, absl::AbortedError(
                    "not sent: an earlier request of the stream failed"));
  }
}

void ClusterDecodeStream::Pump(Lane* lane) {
  Entry* front = lane->unanswered.front();
  absl::StatusOr<v1::AttentionResult> result = lane->stream->Read();
  if (result.ok()) {
    front->result = std::move(result);
    lane->unanswered.pop_front();
    return;
  }
  // The lane's stream has ended at `front`: the replies before it came,
  // and with NOT_FOUND neither it nor anything after it was applied.
  std::deque<Entry*> pending = std::move(lane->unanswered);
  std::shared_ptr<ClusterReplica> replica = lane->replica;
  lanes_.erase(replica.get());
  // The server names the request it ended its stream at ("requests[i]: "):
  // nothing after it there was applied.
  const bool ended_at_front =
      absl::StartsWith(result.status().message(), "requests[");
  absl::Status status = InStreamNumbering(result.status(), front->index);
  if (IsStreamDrained(status)) {
    // The replica's drain ended the stream as it waited: it applied none
    // of `pending`. They go where their sessions are now (confirmed first,
    // as on any replica known to drain); past the bound they fail with
    // that status, which says so.
    cluster_->MarkDraining(*replica);
    if (front->moves < kMaxMoves) {
      ++front->moves;
      DispatchAll(pending);
      return;
    }
  } else if (status.code() == absl::StatusCode::kNotFound &&
             front->moves < kMaxMoves) {
    absl::StatusOr<std::shared_ptr<ClusterReplica>> next =
        cluster_->Recover(front->request.session_id(), "Decode", *replica,
                          status, ClusterClient::Resend::kNever);
    if (next.ok()) {
      ++front->moves;
      DispatchAll(pending);
      return;
    }
    status = next.status();
  } else if (status.code() == absl::StatusCode::kUnavailable) {
    // Recover re-sends only a stream the replica never saw (no connection):
    // then none of its requests was applied.
    absl::StatusOr<std::shared_ptr<ClusterReplica>> next =
        cluster_->Recover(front->request.session_id(), "Decode", *replica,
                          status, ClusterClient::Resend::kNever);
    if (next.ok() && front->moves < kMaxMoves) {
      ++front->moves;
      DispatchAll(pending);
      return;
    }
    if (!next.ok()) status = next.status();
  }
  status = InStreamNumbering(status, front->index);
  for (Entry* entry : pending) {
    // Written before `front`, it waited behind it after a move (Dispatch
    // queues a moved request behind what waits at its new owner).
    Fail(entry,
         entry->index < front->index
             ? BehindAFailedRequest(entry->index, entry->request.session_id(),
                                    front->index, status, ended_at_front)
             : status);
  }
}

bool ClusterDecodeStream::Write(const v1::DecodeRequest& request) {
  if (final_status_.has_value() || first_failed_ != kNoFailure ||
      writes_done_) {
    return false;
  }
  entries_.push_back(std::make_unique<Entry>());
  entries_.back()->index = written_++;
  entries_.back()->request = request;
  Dispatch(entries_.back().get());
  // After the dispatch, so that the lane this request went to (a draining
  // replica that still holds its session) stays open.
  CloseIdleLanes();
  return true;
}

absl::StatusOr<v1::AttentionResult> ClusterDecodeStream::Read() {
  if (final_status_.has_value()) {
    if (!final_status_->ok()) return *final_status_;
    return absl::OutOfRangeError("the Decode stream has ended");
  }
  if (entries_.empty()) {
    if (writes_done_)
      return absl::OutOfRangeError("the Decode stream has ended");
    return absl::FailedPreconditionError(
        "Read without a written request waiting for its result");
  }
  Entry* front = entries_.front().get();
  while (!front->result.has_value()) Pump(front->lane);
  absl::StatusOr<v1::AttentionResult> result = std::move(*front->result);
  entries_.pop_front();
  if (!result.ok()) {
    final_status_ = result.status();
    lanes_.clear();  // cancels the other replicas' streams
  }
  return result;
}

absl::StatusOr<v1::AttentionResult> ClusterDecodeStream::Step(
    const v1::DecodeRequest& request) {
  Write(request);
  return Read();
}

void ClusterDecodeStream::WritesDone() { writes_done_ = true; }

absl::Status ClusterDecodeStream::Finish() {
  if (final_status_.has_value()) return *final_status_;
  writes_done_ = true;
  while (!entries_.empty()) {
    if (absl::StatusOr<v1::AttentionResult> result = Read(); !result.ok()) {
      return result.status();
    }
  }
  // Every request is answered: how a lane's stream ends (a draining
  // replica ends an idle one near its deadline) loses nothing.
  for (auto& [replica, lane] : lanes_) lane->stream->Finish().IgnoreError();
  for (auto& lane : closing_) lane->stream->Finish().IgnoreError();
  lanes_.clear();
  closing_.clear();
  final_status_ = absl::OkStatus();
  return *final_status_;
}

}  // namespace attention::client
