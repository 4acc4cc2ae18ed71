#include "server/peers.h"

#include <netdb.h>
#include <sys/socket.h>
#include <sys/types.h>

#include <algorithm>
#include <set>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"
#include "server/log.h"

namespace attention::server {
namespace {

// The addresses `host` resolves to, as gRPC targets with `port`; a
// bracketed IPv6 literal stays as it is.
std::vector<std::string> Resolve(const HostPort& entry) {
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
  if (error != 0) {
    Log(LogLevel::kWarning, "peer_unresolved",
        {{"host", entry.host}, {"error", gai_strerror(error)}});
    return targets;
  }
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

absl::StatusOr<std::unique_ptr<Peers>> Peers::Create(PeerOptions options) {
  std::vector<HostPort> entries;
  for (absl::string_view entry :
       absl::StrSplit(options.peers, ',', absl::SkipWhitespace())) {
    absl::StatusOr<HostPort> parsed =
        ParseHostPort(absl::StripAsciiWhitespace(entry), "--peers entry");
    if (!parsed.ok()) return parsed.status();
    entries.push_back(*std::move(parsed));
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

absl::StatusOr<v1::ServerInfo> Peers::Probe(const std::string& target,
                                            const std::string& server_name) {
  {
    absl::MutexLock lock(&mu_);
    auto failed = failed_.find(target);
    if (failed != failed_.end() &&
        absl::Now() - failed->second.when < options_.failure_backoff) {
      return absl::Status(failed->second.error.code(),
                          absl::StrCat("did not answer recently: ",
                                       failed->second.error.message()));
    }
  }
  std::shared_ptr<client::AttentionClient> client =
      ClientFor(target, server_name);
  absl::StatusOr<v1::ServerInfo> info = client->GetServerInfo();
  absl::StatusOr<client::ServingStatus> health =
      client->CheckHealth("attention.v1.AttentionService");
  absl::MutexLock lock(&mu_);
  if (!info.ok() || !health.ok()) {
    const absl::Status error = info.ok() ? health.status() : info.status();
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

std::vector<Peer> Peers::Serving(bool* unanswered) {
  std::vector<Peer> serving;
  if (unanswered != nullptr) *unanswered = false;
  for (const HostPort& entry : entries_) {
    for (const std::string& target : Resolve(entry)) {
      absl::StatusOr<v1::ServerInfo> info = Probe(target, entry.host);
      if (unanswered != nullptr &&
          info.status().code() == absl::StatusCode::kDeadlineExceeded) {
        *unanswered = true;
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
      serving.push_back(Peer{.target = target,
                             .advertise_address = info->advertise_address(),
                             .kv_cache_free_bytes = info->kv_cache_free_bytes(),
                             .client = ClientFor(target, entry.host)});
    }
  }
  std::stable_sort(serving.begin(), serving.end(),
                   [](const Peer& a, const Peer& b) {
                     return a.kv_cache_free_bytes > b.kv_cache_free_bytes;
                   });
  return serving;
}

}  // namespace attention::server
