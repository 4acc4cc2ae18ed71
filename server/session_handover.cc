#include "server/session_handover.h"

#include <grpcpp/client_context.h>
#include <grpcpp/support/string_ref.h>

#include <algorithm>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "attention/v1/attention.grpc.pb.h"
#include "client/attention_client.h"
#include "core/status_macros.h"
#include "server/log.h"
#include "server/session_transfer.h"

namespace attention::server {
namespace {

// How long one attempt to seal a session waits for its running calls
// before the session is put back at the end of the queue.
constexpr absl::Duration kSealWait = absl::Milliseconds(500);
// How long a probe of the peers serves the sessions handed over next.
constexpr absl::Duration kPeerProbeInterval = absl::Seconds(1);
// The least and the most of a hand-over's time kept for the answer to its
// last import (the least: at most half of a short hand-over).
constexpr absl::Duration kMinAnswerReserve = absl::Milliseconds(250);
constexpr absl::Duration kMaxAnswerReserve = absl::Seconds(2);

// Whether `metadata` sets `key` to "1".
bool Flagged(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata,
             const char* key) {
  auto it = metadata.find(key);
  return it != metadata.end() && it->second == "1";
}

}  // namespace

SessionHandover::Doubt SessionHandover::DoubtOf(const grpc::Status& status,
                                                bool all_sent, bool refused) {
  if (!all_sent || refused) return Doubt::kNone;
  switch (status.error_code()) {
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::INTERNAL:
      return Doubt::kUnknown;
    // A peer cancels an import only while it still reads it (its stall
    // watchdog), before anything is created, and then its refusal's
    // trailer is lost with the call: asked again, it answers.
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::UNAVAILABLE:
    // Not the handler's refusal (that says so in its trailer): gRPC's own,
    // either the peer's transport refusing a record (nothing created) or
    // this side refusing the peer's answer as too large (created).
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return Doubt::kBroken;
    default:
      return Doubt::kNone;
  }
}

SessionHandover::AfterDoubt SessionHandover::NextAfterDoubt(int attempt,
                                                            Doubt first,
                                                            Doubt doubt,
                                                            bool out_of_time) {
  if (attempt == 0) return {.ask_again = true, .settle = out_of_time};
  // Still in doubt: moved if either answer may mean the peer created it.
  return {.moved = first == Doubt::kUnknown || doubt == Doubt::kUnknown};
}

HandoverDeadlines HandoverDeadlines::For(absl::Time start, absl::Time end) {
  const absl::Duration time = std::max(end - start, absl::ZeroDuration());
  const absl::Duration reserve =
      std::min(std::max(time / 8, std::min(kMinAnswerReserve, time / 2)),
               kMaxAnswerReserve);
  return HandoverDeadlines{
      .send = end - reserve, .answer = end, .reserve = reserve};
}

HandoverDeadlines HandoverDeadlines::Settling(absl::Time now) const {
  return HandoverDeadlines{
      .send = now + reserve, .answer = now + 2 * reserve, .reserve = reserve};
}

SessionHandover::SessionHandover(AttentionEngine* engine, Peers* peers,
                                 ServerMetrics* metrics,
                                 std::string self_address)
    : engine_(engine),
      peers_(peers),
      metrics_(metrics),
      self_address_(std::move(self_address)) {}

HandoverResult SessionHandover::HandOverAll(absl::Time deadline) {
  const absl::Time start = absl::Now();
  const HandoverDeadlines deadlines = HandoverDeadlines::For(start, deadline);
  HandoverResult result;
  std::vector<std::string> queue;
  for (std::string after;;) {
    std::vector<AttentionEngine::SessionOwner> page =
        engine_->ListAllSessionOwners(after, 1000);
    if (page.empty()) break;
    for (auto& session : page) queue.push_back(std::move(session.session_id));
    after = queue.back();
  }
  // A session that may move later (busy, or refused by every peer) goes
  // back to the end of the queue, once.
  absl::flat_hash_set<std::string> retried;
  for (size_t i = 0; i < queue.size(); ++i) {
    if (absl::Now() >= deadlines.send) {
      result.left += static_cast<int64_t>(queue.size() - i);
      break;
    }
    Outcome outcome = HandOver(queue[i], deadlines);
    while (outcome == Outcome::kNoPeer && unanswered_ &&
           absl::Now() + kPeerProbeInterval < deadlines.send) {
      // A peer that did not answer in time may be busy: ask again.
      absl::SleepFor(kPeerProbeInterval);
      outcome = HandOver(queue[i], deadlines);
    }
    if (outcome == Outcome::kNoPeer) {
      result.left += static_cast<int64_t>(queue.size() - i);
      break;
    }
    if (outcome == Outcome::kFailed && retried.insert(queue[i]).second) {
      queue.push_back(queue[i]);
      continue;
    }
    if (outcome == Outcome::kSent) ++result.sent;
    if (outcome == Outcome::kFailed || outcome == Outcome::kRefused) {
      ++result.failed;
    }
  }
  if (metrics_ != nullptr) {
    metrics_->RecordHandovers(result.sent, result.failed + result.left);
  }
  result.duration = absl::Now() - start;
  return result;
}

const std::vector<Peer>& SessionHandover::ServingPeers(bool refresh,
                                                       absl::Time deadline) {
  if (refresh || absl::Now() - probed_ >= kPeerProbeInterval) {
    serving_ = peers_->Serving(deadline, &unanswered_);
    probed_ = absl::Now();
  }
  return serving_;
}

SessionHandover::Outcome SessionHandover::HandOver(
    const std::string& id, const HandoverDeadlines& deadlines) {
  const std::vector<Peer> peers =
      ServingPeers(std::exchange(refresh_, false), deadlines.send);
  // The probes may have taken the time to send (they end by it).
  if (peers.empty() || absl::Now() >= deadlines.send) return Outcome::kNoPeer;
  absl::StatusOr<SessionSeal> seal = engine_->SealSession(
      id, std::min(deadlines.send, absl::Now() + kSealWait));
  if (!seal.ok()) {
    // Deleted or expired meanwhile: nothing to move.
    if (seal.status().code() == absl::StatusCode::kNotFound) {
      return Outcome::kGone;
    }
    Log(LogLevel::kWarning, "handover_failed",
        {{"session", id}, {"error", seal.status().ToString()}});
    return Outcome::kFailed;
  }
  InDoubt in_doubt;
  for (const Peer& peer : peers) {
    if (absl::Now() >= deadlines.send) break;  // out of time: it stays
    // An export this replica refuses (an MLA or top-k session) goes nowhere.
    absl::StatusOr<std::unique_ptr<SessionExport>> session_export =
        engine_->ExportSealed(*seal);
    if (!session_export.ok()) {
      Log(LogLevel::kWarning, "handover_failed",
          {{"session", id}, {"error", session_export.status().ToString()}});
      return Outcome::kRefused;
    }
    bool moved = false;
    const absl::Status sent = MoveTo(peer, *seal, *std::move(session_export),
                                     deadlines, &in_doubt, &moved);
    if (sent.ok() || moved) {
      // Never live on two replicas: an unknown outcome counts as moved.
      seal->Commit(peer.advertise_address);
      Log(sent.ok() ? LogLevel::kInfo : LogLevel::kError, "handover",
          {{"session", id},
           {"to", peer.advertise_address},
           {"error", sent.ok() ? std::string() : sent.ToString()}});
      return sent.ok() ? Outcome::kSent : Outcome::kRefused;
    }
    Log(LogLevel::kWarning, "handover_refused",
        {{"session", id},
         {"to", peer.advertise_address},
         {"error", sent.ToString()}});
  }
  refresh_ = true;
  return Outcome::kFailed;
}

absl::Status SessionHandover::MoveTo(
    const Peer& peer, SessionSeal& seal,
    std::unique_ptr<SessionExport> session_export,
    const HandoverDeadlines& deadlines, InDoubt* in_doubt, bool* moved) {
  *moved = false;
  Doubt first = Doubt::kNone;
  HandoverDeadlines current = deadlines;
  for (int attempt = 0;; ++attempt) {
    if (attempt > 0) {
      // A re-export that fails leaves the first attempt's doubt standing.
      *moved = first == Doubt::kUnknown;
      ATTN_ASSIGN_OR_RETURN(session_export, engine_->ExportSealed(seal));
    }
    Doubt doubt = Doubt::kNone;
    const absl::Status sent =
        SendTo(peer, *session_export, current, in_doubt, &doubt);
    if (attempt == 0) first = doubt;
    if (sent.ok()) return sent;
    if (doubt == Doubt::kNone) {
      // Refused. A second attempt's refusal (say, the peer ran out of
      // memory) says nothing of what the first one left there, unless the
      // peer looked the id up first (SendTo then took it out of *in_doubt).
      *moved = first == Doubt::kUnknown &&
               in_doubt->contains(peer.advertise_address);
      return sent;
    }
    const absl::Time now = absl::Now();
    const AfterDoubt next =
        NextAfterDoubt(attempt, first, doubt, now >= deadlines.send);
    if (!next.ask_again) {
      *moved = next.moved;
      return sent;
    }
    // Asked again, the peer settles it (ALREADY_EXISTS, or it takes the
    // session now); at the end of the time, in a short extension.
    if (next.settle) current = deadlines.Settling(now);
    Log(LogLevel::kWarning, "handover_doubt",
        {{"session", seal.session().id()},
         {"to", peer.advertise_address},
         {"error", sent.ToString()}});
  }
}

absl::Status SessionHandover::SendTo(const Peer& peer,
                                     SessionExport& session_export,
                                     const HandoverDeadlines& deadlines,
                                     InDoubt* in_doubt, Doubt* doubt) {
  *doubt = Doubt::kNone;
  auto stub = v1::AttentionService::NewStub(peer.client->channel());
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(deadlines.answer));
  context.AddMetadata(kHandoverMetadata, self_address_);
  const std::string& token = peers_->options().client.auth_token;
  if (!token.empty()) {
    context.AddMetadata("authorization", absl::StrCat("Bearer ", token));
  }
  v1::SessionInfo reply;
  std::unique_ptr<grpc::ClientWriter<v1::SessionChunk>> writer =
      stub->ImportSession(&context, &reply);
  // Asking again about an earlier attempt's doubt: the peer's word on the
  // id (kImportIdCheckedMetadata) settles it even if this attempt is cut.
  const bool settling = in_doubt->contains(peer.advertise_address);
  bool header_sent = false;
  bool all_sent = true;
  const absl::StatusOr<int64_t> written = WriteSessionExport(
      session_export,
      [&](v1::SessionChunk& record) -> absl::Status {
        if (record.has_header()) record.set_keep_session_id(true);
        if (absl::Now() >= deadlines.send) {
          // Cancelled below: the peer creates nothing, the session stays.
          return absl::DeadlineExceededError(
              "the hand-over ran out of time before the session was sent");
        }
        if (!writer->Write(record)) {
          all_sent = false;
          return absl::UnavailableError("the peer closed the import stream");
        }
        header_sent = true;
        return absl::OkStatus();
      },
      peers_->options().client.max_send_message_bytes);
  if (!written.ok() && all_sent) {
    // Out of time, or the export failed mid-way: end the import so the
    // peer drops it. A second attempt first takes the peer's word on the
    // id, which it sends right after the header (the call's deadline
    // bounds the wait; an older peer sends none before its answer).
    if (settling && header_sent) writer->WaitForInitialMetadata();
    context.TryCancel();
    all_sent = false;
  }
  writer->WritesDone();
  const grpc::Status status = writer->Finish();
  if (status.ok() && written.ok()) {
    if (metrics_ != nullptr) metrics_->RecordExport(*written);
    return absl::OkStatus();
  }
  if (status.ok()) {
    // An import ends with its trailer: a peer that accepts one cut short
    // breaks the protocol, and the session stays here.
    return absl::InternalError(
        absl::StrCat("peer ", peer.advertise_address,
                     " accepted an import that was cut short (",
                     written.status().message(), "); the session stays here"));
  }
  if (status.error_code() == grpc::StatusCode::ALREADY_EXISTS &&
      in_doubt->contains(peer.advertise_address)) {
    // An earlier attempt whose answer was lost created it there.
    Log(LogLevel::kWarning, "handover_found_on_peer",
        {{"to", peer.advertise_address}, {"error", status.error_message()}});
    return absl::OkStatus();
  }
  *doubt = DoubtOf(
      status, all_sent,
      Flagged(context.GetServerTrailingMetadata(), kImportRefusedMetadata));
  if (*doubt != Doubt::kNone) {
    in_doubt->insert(peer.advertise_address);
  } else if (Flagged(context.GetServerInitialMetadata(),
                     kImportIdCheckedMetadata)) {
    // The peer looked the id up and did not hold it, and this attempt
    // created nothing: no earlier attempt of this seal left it there.
    in_doubt->erase(peer.advertise_address);
  }
  if (!written.ok() && status.error_code() == grpc::StatusCode::CANCELLED) {
    return written.status();
  }
  return absl::Status(client::FromGrpcStatus(status).code(),
                      absl::StrCat("peer ", peer.advertise_address, ": ",
                                   status.error_message()));
}

}  // namespace attention::server
