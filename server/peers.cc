#include "server/peers.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <algorithm>
#include <optional>
#include <set>
#include <system_error>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/time/clock.h"
#include "core/client_string.h"
#include "server/log.h"

namespace attention::server {
namespace {

// The service whose health a probe asks for.
constexpr char kServiceName[] = "attention.v1.AttentionService";

// Whether `host` is an address rather than a name: resolving it asks no
// DNS server, so it never blocks.
bool IsAddressLiteral(const std::string& host) {
  in_addr ipv4;
  return (!host.empty() && host.front() == '[') ||
         inet_pton(AF_INET, host.c_str(), &ipv4) == 1;
}

// The addresses `entry`'s host resolves to, as gRPC targets with its port;
// a bracketed IPv6 literal stays as it is. Blocks on DNS for a name.
absl::StatusOr<std::vector<std::string>> Resolve(const HostPort& entry) {
  std::vector<std::string> targets;
  if (!entry.host.empty() && entry.host.front() == '[') {
    targets.push_back(absl::StrCat(entry.host, ":", entry.port));
    return targets;
  }
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int error = getaddrinfo(entry.host.c_str(), nullptr, &hints, &found);
  if (error != 0) return absl::NotFoundError(gai_strerror(error));
  std::set<std::string> seen;
  for (addrinfo* address = found; address != nullptr;
       address = address->ai_next) {
    char text[NI_MAXHOST] = {};
    if (getnameinfo(address->ai_addr, address->ai_addrlen, text, sizeof(text),
                    nullptr, 0, NI_NUMERICHOST) != 0) {
      continue;
    }
    const std::string ip = text;
    const std::string target = address->ai_family == AF_INET6
                                   ? absl::StrCat("[", ip, "]:", entry.port)
                                   : absl::StrCat(ip, ":", entry.port);
    if (seen.insert(target).second) targets.push_back(target);
  }
  freeaddrinfo(found);
  return targets;
}

}  // namespace

// A name's look-up on a thread of its own, which outlives a Serving() that
// stops waiting for it (and the Peers, if need be).
struct Peers::PendingLookup {
  absl::Mutex mu;
  bool done ABSL_GUARDED_BY(mu) = false;
  absl::StatusOr<std::vector<std::string>> targets ABSL_GUARDED_BY(mu);
};

std::shared_ptr<Peers::PendingLookup> Peers::StartLookup(
    const HostPort& entry) {
  auto lookup = std::make_shared<PendingLookup>();
  try {
    std::thread([lookup, entry] {
      absl::StatusOr<std::vector<std::string>> targets = Resolve(entry);
      absl::MutexLock done(&lookup->mu);
      lookup->targets = std::move(targets);
      lookup->done = true;
    }).detach();
  } catch (const std::system_error& error) {
    // No thread to spare (a process limit): the name is unresolved now.
    absl::MutexLock done(&lookup->mu);
    lookup->targets = absl::ResourceExhaustedError(
        absl::StrCat("no thread for the look-up: ", error.what()));
    lookup->done = true;
  }
  return lookup;
}

absl::StatusOr<std::unique_ptr<Peers>> Peers::Create(PeerOptions options) {
  std::vector<HostPort> entries;
  for (absl::string_view entry :
       absl::StrSplit(options.peers, ',', absl::SkipWhitespace())) {
    absl::StatusOr<HostPort> parsed =
        ParseHostPort(absl::StripAsciiWhitespace(entry), "--peers entry");
    if (!parsed.ok()) return parsed.status();
    entries.push_back(*std::move(parsed));
  }
  if (entries.empty() && !absl::StripAsciiWhitespace(options.peers).empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--peers ", QuoteClientString(options.peers),
        " names no peer: give host:port entries separated by commas"));
  }
  return std::unique_ptr<Peers>(
      new Peers(std::move(options), std::move(entries)));
}

std::shared_ptr<client::AttentionClient> Peers::ClientFor(
    const std::string& target, const std::string& server_name) {
  absl::MutexLock lock(&mu_);
  std::shared_ptr<client::AttentionClient>& client = clients_[target];
  if (client == nullptr) {
    client::ClientOptions options = options_.client;
    if (client::UsesTls(options) && options.tls_server_name.empty()) {
      options.tls_server_name = server_name;
    }
    options.retry_max_attempts = 1;
    options.call_timeout = options_.probe_timeout;
    client = std::shared_ptr<client::AttentionClient>(
        client::AttentionClient::Connect(target, options));
  }
  return client;
}

std::vector<Peers::Candidate> Peers::Resolved(absl::Time deadline,
                                              bool* unanswered) {
  // Every name's look-up starts at once (or is still running from an
  // earlier call); addresses need none.
  std::vector<std::shared_ptr<PendingLookup>> lookups(entries_.size());
  {
    absl::MutexLock lock(&mu_);
    for (size_t i = 0; i < entries_.size(); ++i) {
      if (IsAddressLiteral(entries_[i].host)) continue;
      if (lookups_[i] == nullptr) lookups_[i] = StartLookup(entries_[i]);
      lookups[i] = lookups_[i];
    }
  }
  // A name not resolved within a probe's time is left for a later call, so
  // that one slow name does not hold up the others' probes.
  const absl::Time wait_until =
      std::min(deadline, absl::Now() + options_.probe_timeout);
  std::vector<Candidate> candidates;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const HostPort& entry = entries_[i];
    absl::StatusOr<std::vector<std::string>> targets;
    if (IsAddressLiteral(entry.host)) {
      targets = Resolve(entry);
    } else {
      PendingLookup& lookup = *lookups[i];
      const bool done = lookup.mu.LockWhenWithDeadline(
          absl::Condition(&lookup.done), wait_until);
      if (done) targets = lookup.targets;
      lookup.mu.Unlock();
      if (!done) {
        Log(LogLevel::kWarning, "peer_lookup_slow", {{"host", entry.host}});
        *unanswered = true;
        continue;
      }
      absl::MutexLock lock(&mu_);
      if (lookups_[i] == lookups[i]) lookups_[i] = nullptr;
    }
    if (!targets.ok()) {
      Log(LogLevel::kWarning, "peer_unresolved",
          {{"host", entry.host}, {"error", targets.status().message()}});
      continue;
    }
    for (std::string& target : *targets) {
      candidates.push_back(
          Candidate{.target = std::move(target), .server_name = entry.host});
    }
  }
  return candidates;
}

std::optional<absl::Status> Peers::RecentFailure(const std::string& target) {
  absl::MutexLock lock(&mu_);
  auto failed = failed_.find(target);
  if (failed == failed_.end() ||
      absl::Now() - failed->second.when >= options_.failure_backoff) {
    return std::nullopt;
  }
  return absl::Status(failed->second.error.code(),
                      absl::StrCat("did not answer recently: ",
                                   failed->second.error.message()));
}

std::vector<absl::StatusOr<v1::ServerInfo>> Peers::ProbeAll(
    const std::vector<Candidate>& candidates, absl::Time deadline) {
  const size_t count = candidates.size();
  std::vector<std::optional<absl::Status>> recent(count);
  int asked = 0;
  for (size_t i = 0; i < count; ++i) {
    recent[i] = RecentFailure(candidates[i].target);
    if (!recent[i].has_value()) ++asked;
  }
  // Every address probed at once, on gRPC's callback API; each call ends
  // within probe_timeout (the client's call timeout) and by `deadline`,
  // and each writes only its own slot.
  std::vector<absl::StatusOr<v1::ServerInfo>> infos(count);
  std::vector<absl::StatusOr<client::ServingStatus>> health(count);
  absl::BlockingCounter pending(2 * asked);
  for (size_t i = 0; i < count; ++i) {
    if (recent[i].has_value()) continue;
    std::shared_ptr<client::AttentionClient> client =
        ClientFor(candidates[i].target, candidates[i].server_name);
    client->GetServerInfoAsync(
        [&infos, &pending, i](absl::StatusOr<v1::ServerInfo> info) {
          infos[i] = std::move(info);
          pending.DecrementCount();
        },
        deadline);
    client->CheckHealthAsync(
        kServiceName,
        [&health, &pending, i](absl::StatusOr<client::ServingStatus> serving) {
          health[i] = std::move(serving);
          pending.DecrementCount();
        },
        deadline);
  }
  pending.Wait();
  // A probe the caller's deadline cut is no fault of the peer's.
  const bool cut = absl::Now() >= deadline;
  std::vector<absl::StatusOr<v1::ServerInfo>> probed;
  for (size_t i = 0; i < count; ++i) {
    probed.push_back(recent[i].has_value()
                         ? absl::StatusOr<v1::ServerInfo>(*recent[i])
                         : Judge(candidates[i].target, std::move(infos[i]),
                                 std::move(health[i]), cut));
  }
  return probed;
}

absl::StatusOr<v1::ServerInfo> Peers::Judge(
    const std::string& target, absl::StatusOr<v1::ServerInfo> info,
    absl::StatusOr<client::ServingStatus> health, bool cut) {
  absl::MutexLock lock(&mu_);
  if (!info.ok() || !health.ok()) {
    const absl::Status error = info.ok() ? health.status() : info.status();
    if (cut && error.code() == absl::StatusCode::kDeadlineExceeded) {
      return error;  // not answered in the caller's time: asked again later
    }
    Log(LogLevel::kWarning, "peer_unreachable",
        {{"peer", target}, {"error", error.ToString()}});
    failed_[target] = Failure{.when = absl::Now(), .error = error};
    return error;
  }
  failed_.erase(target);
  if (*health != client::ServingStatus::kServing) {
    return absl::UnavailableError("not SERVING");
  }
  return info;
}

std::vector<Peer> Peers::Serving(absl::Time deadline, bool* unanswered) {
  std::vector<Peer> serving;
  bool late = false;
  const std::vector<Candidate> candidates = Resolved(deadline, &late);
  // No probe starts after the deadline.
  const std::vector<absl::StatusOr<v1::ServerInfo>> infos =
      absl::Now() < deadline ? ProbeAll(candidates, deadline)
                             : std::vector<absl::StatusOr<v1::ServerInfo>>();
  if (infos.size() < candidates.size()) late = true;
  for (size_t i = 0; i < infos.size(); ++i) {
    const std::string& target = candidates[i].target;
    const absl::StatusOr<v1::ServerInfo>& info = infos[i];
    if (info.status().code() == absl::StatusCode::kDeadlineExceeded) {
      late = true;
    }
    if (!info.ok() || info->draining() || info->advertise_address().empty() ||
        info->advertise_address() == options_.self_address) {
      continue;
    }
    // Where clients are sent (redirects, trailing metadata): a peer's
    // address that is not host:port is not followed.
    if (absl::Status usable = ParseHostPort(info->advertise_address(),
                                            "the peer's advertise_address")
                                  .status();
        !usable.ok()) {
      Log(LogLevel::kWarning, "peer_unusable",
          {{"peer", target}, {"error", usable.ToString()}});
      continue;
    }
    // One replica reachable under several addresses counts once.
    if (std::any_of(serving.begin(), serving.end(), [&](const Peer& peer) {
          return peer.advertise_address == info->advertise_address();
        })) {
      continue;
    }
    serving.push_back(
        Peer{.target = target,
             .advertise_address = info->advertise_address(),
             .kv_cache_free_bytes = info->kv_cache_free_bytes(),
             .client = ClientFor(target, candidates[i].server_name)});
  }
  if (unanswered != nullptr) *unanswered = late;
  std::stable_sort(serving.begin(), serving.end(),
                   [](const Peer& a, const Peer& b) {
                     return a.kv_cache_free_bytes > b.kv_cache_free_bytes;
                   });
  return serving;
}

}  // namespace attention::server
